"""The showcase's progress report and its "final loss", the same in both packages.

On a terminal (or in a Jupyter kernel, where ``tqdm.auto`` draws a widget) each fit gets a
progress bar. Elsewhere (a CI log, ``nohup``, a notebook's ``!`` cell, a pipe) a bar would
write every refresh as a new line of the log, so each fit writes one line when it ends.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from typing import TextIO

import numpy as np

# How often the bar's loss is refreshed (every step would slow the loop).
_REFRESH_EVERY = 25


def final_loss(losses: Sequence) -> float:
    """The table's "final loss": the mean of the last tenth of the steps' losses (at least
    one). A single step's loss is a one-sample estimate of the negative ELBO, too noisy
    to compare runs by."""
    return float(np.mean(np.asarray(losses[-averaged_steps(len(losses)) :], dtype=np.float64)))


def averaged_steps(steps: int) -> int:
    """How many of the last steps :func:`final_loss` averages."""
    return max(1, steps // 10)


def is_interactive(stream: TextIO) -> bool:
    """Whether ``stream`` redraws a progress bar in place: a terminal, or a Jupyter kernel's
    stream (whose ``isatty`` is false, but where ``tqdm.auto`` draws a widget)."""
    isatty = getattr(stream, "isatty", None)
    if callable(isatty) and isatty():
        return True
    return type(stream).__module__.split(".")[0] == "ipykernel"


class StageProgress:
    """Iterate over ``range(steps)`` while reporting the progress of one SVI fit.

    ``show_loss(step, loss)`` gives the bar the loss of a step (it reads ``loss`` only every
    25 steps and at the last, so a framework's array is not synchronised every step);
    ``finish(final)`` writes the one line of a non-interactive stream, or puts the final
    loss beside the last step's on the bar.
    """

    def __init__(
        self,
        steps: int,
        desc: str,
        enabled: bool = True,
        stream: TextIO | None = None,
        interactive: bool | None = None,
    ):
        self.steps, self.desc, self.enabled = steps, desc, enabled
        self.stream = sys.stderr if stream is None else stream
        if interactive is None:
            interactive = is_interactive(self.stream)
        self._bar = None
        if enabled and interactive:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=steps, desc=desc, file=self.stream, leave=True)
        self._last_loss = None
        self._start = time.perf_counter()

    def __iter__(self) -> Iterator[int]:
        self._start = time.perf_counter()
        for step in range(self.steps):
            yield step
            if self._bar is not None:
                self._bar.update(1)

    def show_loss(self, step: int, loss) -> None:
        if step % _REFRESH_EVERY == 0 or step == self.steps - 1:
            self._last_loss = float(loss)
            if self._bar is not None:
                self._bar.set_postfix(loss=f"{self._last_loss:.4g}", refresh=False)

    def finish(self, final: float) -> None:
        averaged = averaged_steps(self.steps)
        if self._bar is not None:
            shown = {} if self._last_loss is None else {"loss": f"{self._last_loss:.4g}"}
            self._bar.set_postfix(**shown, **{f"mean_last_{averaged}": f"{final:.4g}"})
            self._bar.close()
        elif self.enabled:
            last = "" if self._last_loss is None else f"last step's loss {self._last_loss:.4g}, "
            print(
                f"{self.desc}: {self.steps} SVI steps in {time.perf_counter() - self._start:.1f}"
                f" s; {last}final loss {final:.4g} (mean of the last {averaged})",
                file=self.stream,
                flush=True,
            )
