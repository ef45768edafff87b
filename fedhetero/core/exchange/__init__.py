"""What travels between the server and its clients (:mod:`.types`: tasks, results, outcomes,
bytes, seeds), how uploads are averaged, also while they arrive (:mod:`.aggregation`), and where
a client's private state waits between its rounds (:mod:`.store`)."""
