"""The step cost model fitted online, on the steps the engine serves, with the error it makes.

SLOWeave and WavePP need ``T(n, c, x)``, the time of a step with ``n`` decodes, ``c`` prefill
tokens and ``x`` context tokens (:mod:`.cost_model`). Instead of a file made beforehand, the
scheduler feeds each step it timed to :meth:`OnlineCostModel.observe`:

    T(n, c, x)     = the StepCostModel fitted by NNLS on the last W measured steps, refitted
                     every K new steps (monotone in c by construction, as the offline fit); the
                     prior while the window holds fewer than 2·|features| steps or fewer than
                     3 distinct prefill sizes (the first fit comes as soon as it holds them)
    upper(n, c, x) = T(n, c, x) · (1 + q_s)
    q_s            = max(0, quantile_q { (measured − predicted) / predicted }) over the last R
                     steps of the shape class s = ([n>0], [c>0]) (all classes while s has
                     fewer than 16), the prediction being the one the scheduler relied on

SLOWeave meets its deadline against ``upper``: the margin is the model's own recent error on
steps like this one, not a fixed number of milliseconds. The prior is a ``--cost-model`` file
(``preft eval profile``) or :meth:`OnlineCostModel.conservative_prior`, which costs prefill
tokens high so that the first chunks beside decodes are small until the engine's own steps say
otherwise (a decode-free step still prefills all it can: the window gets large chunks too).

The state (window, residuals, weights) is written atomically with :meth:`save` and read back
with :meth:`restore`, so a restarted server starts from what it learned. A refit solves NNLS
on a W×8 matrix (a few milliseconds at W = 512, every 32 steps); ``overhead_s`` and
``observed_s`` keep the time spent observing against the time of the steps observed (0.2% of
the step time on the 512x8 model's served steps here, replayed; SLOWeave's twelve or so probes
of the bound a step add about 1%).

Plain Python (numpy): the simulator and the engine's scheduler use the same object.

>>> model = OnlineCostModel(StepCostModel([0.01, 0, 0, 0, 0.001, 0, 0, 0]), refit_every=4)
>>> for step in range(40):
...     c = 16 * (1 + step % 4)
...     model.observe(0, c, 0, 0.002 + 0.0001 * c)  # the engine is faster than the prior says
>>> round(model(0, 64, 0) * 1e3, 2), model.fits > 0
(8.4, True)
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from pathlib import Path

import numpy as np

from preft.serving.scheduling.atomic_file import write_atomically
from preft.serving.scheduling.cost_model import FEATURES, StepCostModel

#: shape classes of the residuals: (has decodes, has prefill)
SHAPE_CLASSES = ((False, False), (False, True), (True, False), (True, True))
STATE_FORMAT = "preft-online-step-cost/1"


def _class_key(n: int, c: int) -> str:
    return f"{int(n > 0)}{int(c > 0)}"


class OnlineCostModel:
    """``T(n, c, x)`` refitted on the last ``window`` served steps (see the module docstring);
    callable like :class:`StepCostModel`."""

    def __init__(self, prior: StepCostModel, window: int = 512, refit_every: int = 32, residuals: int = 256,
                 quantile: float = 0.95) -> None:
        if window < 2 * len(FEATURES) or refit_every < 1 or residuals < 16 or not 0.5 <= quantile < 1:
            raise ValueError(f"an online cost model needs window >= {2 * len(FEATURES)}, refit_every >= 1, "
                             f"residuals >= 16 and 0.5 <= quantile < 1 (got {window}, {refit_every}, {residuals}, "
                             f"{quantile})")
        self.prior, self.quantile, self.refit_every = prior, quantile, refit_every
        self.model = prior
        self.steps: deque = deque(maxlen=window)  # (n, c, x, seconds)
        self.residuals = {_class_key(n, c): deque(maxlen=residuals) for n, c in SHAPE_CLASSES}
        self.since_fit, self.fits = 0, 0
        self.overhead_s = self.observed_s = 0.0
        self._quantiles: dict[str, float] = {}  # q_s per class, until the next observed step

    @classmethod
    def conservative_prior(cls) -> StepCostModel:
        """Before any step is measured: 25 ms a step, 1 ms a decode, 2 ms a prefill token (a TPOT
        of 100 ms fits about 37 prefill tokens beside one decode). Twice the largest per-token
        prefill cost measured in this project (the 512x8 model on 2 CPU cores, 0.71 ms), so the
        first deadlines are met; the first fit, once 16 steps with 3 prefill sizes are in, replaces it."""
        ms = 1e-3
        return StepCostModel([25 * ms, 0.0, 1 * ms, 0.0, 2 * ms, 0.0, 0.0, 0.0], source="conservative prior")

    @property
    def source(self) -> str:
        return f"online ({self.fits} fits on {len(self.steps)} steps)" if self.fits else f"online, {self.prior.source}"

    @property
    def meta(self) -> dict:
        return self.prior.meta

    @property
    def weights(self) -> list[float]:
        return self.model.weights

    def __call__(self, num_decodes: int, prefill_tokens: int, context_tokens: int = 0) -> float:
        return self.model(num_decodes, prefill_tokens, context_tokens)

    def error_quantile(self, num_decodes: int, prefill_tokens: int) -> float:
        """``q_s``: the model's recent relative under-prediction on steps of this shape class
        (computed once per class between two observed steps: SLOWeave asks it at every probe
        of its binary search)."""
        key = _class_key(num_decodes, prefill_tokens)
        if key not in self._quantiles:
            recent = self.residuals[key]
            if len(recent) < 16:
                recent = [r for values in self.residuals.values() for r in values]
            self._quantiles[key] = 0.0 if len(recent) < 16 else max(
                0.0, float(np.quantile(np.fromiter(recent, float), self.quantile)))
        return self._quantiles[key]

    def upper(self, num_decodes: int, prefill_tokens: int, context_tokens: int = 0) -> float:
        """``T · (1 + q_s)``: what a deadline check should assume this step takes."""
        return self(num_decodes, prefill_tokens, context_tokens) * (1.0 + self.error_quantile(num_decodes,
                                                                                               prefill_tokens))

    def observe(self, n: int, c: int, x: int, seconds: float) -> None:
        """One measured step: its residual against the current model, then into the window (a
        refit every ``refit_every`` steps once the window is rich enough)."""
        started = time.perf_counter()
        self._quantiles = {}
        if seconds > 0 and math.isfinite(seconds):
            predicted = self(n, c, x)
            if predicted > 0:
                self.residuals[_class_key(n, c)].append((seconds - predicted) / predicted)
            self.steps.append((int(n), int(c), int(x), float(seconds)))
            self.observed_s += seconds
            self.since_fit += 1
            due = self.since_fit >= self.refit_every or self.fits == 0  # the prior goes as soon as it can
            if due and self.rich_enough():
                self.refit()
        self.overhead_s += time.perf_counter() - started

    def rich_enough(self) -> bool:
        """Enough steps, with enough distinct prefill sizes, to fit every term."""
        sizes = {c for _, c, _, _ in self.steps if c > 0}
        return len(self.steps) >= 2 * len(FEATURES) and len(sizes) >= 3

    def refit(self) -> None:
        shapes = [(n, c, x) for n, c, x, _ in self.steps]
        self.model = StepCostModel.fit(shapes, [s for *_, s in self.steps], source="online",
                                       meta={"window_steps": len(self.steps)})
        self.since_fit, self.fits = 0, self.fits + 1

    def report(self) -> dict:
        """The fit and its error, kept in the state file: weights, steps, ``q_s`` per class, the
        median absolute relative residual, and the time spent here per second of steps."""
        every = [abs(r) for values in self.residuals.values() for r in values]
        return {"source": self.source, "weights": self.weights, "fits": self.fits, "window_steps": len(self.steps),
                "error_quantile": {key: self.error_quantile(int(key[0]), int(key[1])) for key in self.residuals},
                "median_abs_relative_error": float(np.median(every)) if every else None,
                "overhead_fraction": self.overhead_s / self.observed_s if self.observed_s else None}

    def to_json(self) -> dict:
        return {"format": STATE_FORMAT, "prior": self.prior.to_json(), "weights": self.weights, "fits": self.fits,
                "report": self.report(), "steps": [list(step) for step in self.steps],
                "residuals": {key: list(values) for key, values in self.residuals.items()}}

    def save(self, path: str | Path) -> Path:
        """Write the state atomically (:func:`.atomic_file.write_atomically`)."""
        return write_atomically(path, json.dumps(self.to_json()) + "\n")

    def restore(self, path: str | Path) -> None:
        """Continue from a state :meth:`save` wrote (its window, residuals and fit); one clear
        error naming the file when it is not one."""
        try:
            data = json.loads(Path(path).read_text())
            if not isinstance(data, dict) or data.get("format") != STATE_FORMAT:
                raise ValueError(f"not a {STATE_FORMAT} state")
            steps = [tuple(step) for step in data["steps"]]
            if not all(len(step) == 4 and all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0
                                              for v in step) for step in steps):
                raise ValueError("a step is not four finite numbers >= 0")
            residuals = data["residuals"]
            if set(residuals) != set(self.residuals) or not all(
                    isinstance(r, (int, float)) and math.isfinite(r) for values in residuals.values() for r in values):
                raise ValueError("residuals are not finite numbers per shape class")
            model = StepCostModel([float(w) for w in data["weights"]], source="online")
            fits = int(data["fits"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"the online step cost state {path} cannot be used ({err}); move it away to start "
                             "afresh") from None
        self.steps.extend((int(n), int(c), int(x), float(s)) for n, c, x, s in steps)
        for key, values in residuals.items():
            self.residuals[key].extend(float(r) for r in values)
        self._quantiles = {}
        if fits:
            self.model, self.fits = model, fits


def online_model_of(policy) -> OnlineCostModel | None:
    """The online cost model a chunk policy plans with (SLOWeave's, WavePP's, or the one both
    share in ``sloweave+wavepp``), or None: the scheduler and the simulator feed it each step."""
    for holder in (policy, getattr(policy, "sloweave", None), getattr(policy, "stage_cost", None)):
        model = getattr(holder, "cost_model", None)
        if isinstance(model, OnlineCostModel):
            return model
    return None
