"""DynInit: initialising the global model at a session transition (devices arriving and leaving)
from earlier sessions' models."""
