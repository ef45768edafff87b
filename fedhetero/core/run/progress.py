"""The progress a run shows while it trains: a rich progress bar on a terminal, one plain line a
round otherwise."""

from __future__ import annotations

import time
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


#: environment variable that turns internal errors from dropped clients into a stopped run
STRICT_ENV = "FEDHETERO_STRICT"
#: evaluations the summary's ``smoothed_final_accuracy`` smooths over (the FedDUMAP paper's window);
#: a run with fewer evaluations reports none
SMOOTHING_WINDOW = 39



__all__ = ["RoundProgress"]


class RoundProgress:
    """Progress over rounds and clients: a rich display on a terminal, one plain line per round
    otherwise (``| tee``, ``nohup``, cluster logs); silent when disabled."""

    def __init__(self, enabled: bool, rounds: int, start: int, console: Any) -> None:
        self.enabled = enabled
        self.rounds = rounds
        self.start = start
        self.console = console
        self._progress: Any = None
        self._plain = False
        self._t0 = time.perf_counter()

    def __enter__(self) -> "RoundProgress":
        if not self.enabled:
            return self
        if self.console is not None and not self.console.is_terminal:
            self._plain = True
            return self

        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
        )
        self._progress.__enter__()
        self._rounds_task = self._progress.add_task("rounds", total=self.rounds, completed=self.start, info="")
        self._client_task = self._progress.add_task("clients", total=1, info="")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def round_started(self, rnd: int, n_clients: int) -> None:
        if self._progress is not None:
            self._progress.reset(self._client_task, total=n_clients, info=f"round {rnd}")

    def client_done(self, cid: int) -> None:
        if self._progress is not None:
            self._progress.advance(self._client_task)

    def round_done(self, row: dict[str, Any]) -> None:
        if self._progress is not None:
            info = f"acc {row['accuracy']:.3f}" if "accuracy" in row else ""
            self._progress.update(self._rounds_task, advance=1, info=info)
        elif self._plain:
            acc = f" accuracy {row['accuracy']:.4f}" if row.get("accuracy") is not None else ""
            dropped = f" dropped {len(row['dropped'])}" if row.get("dropped") else ""
            self.console.print(
                f"round {row['round']}/{self.rounds}{acc} clients {len(row['clients'])}{dropped} "
                f"round {row['wall_s']:.2f} s elapsed {time.perf_counter() - self._t0:.1f} s",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )


