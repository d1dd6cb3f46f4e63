"""The step cost model: how long one engine step takes, from the step's shape.

    T(n, c, x) = w0 + w1·[n>0] + w2·n + w3·[c>0] + w4·c + w5·c²/10³ + w6·x/10³ + w7·c·x/10⁶   (seconds)

- ``n``: decoding requests in the step (one token each),
- ``c``: prefill tokens in the step (the chunk; all prefilling requests together),
- ``x``: context tokens: KV already cached for the step's requests (their computed tokens),
  which decode attention reads and a chunk's attention reads once per chunk token.

The weights are fitted by non-negative least squares on step times measured on the real engine
(``preft eval profile``), so ``T`` is **monotone in c by construction**: every term that
grows with ``c`` has a weight >= 0, which SLOWeave's binary search needs. A term the data does
not support gets weight 0. The indicator terms carry the fixed cost of having a decode batch or
a prefill at all (kernel launches, metadata), which a purely linear model misses.

:meth:`StepCostModel.synthetic` is the SLOWeave paper's default cost, for tests and for
simulating before a profile exists: ``0.35 + [n>0](0.90 + 0.055 n) + [c>0](0.40 + 0.006 c)`` ms.

Plain Python (numpy): the simulator and the engine's scheduler use the same object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from preft.serving.scheduling.atomic_file import write_atomically

FEATURES = ("1", "[n>0]", "n", "[c>0]", "c", "c^2/1e3", "x/1e3", "c*x/1e6")


def features(n: int, c: int, x: int) -> list[float]:
    """The model's terms for one step shape (the order of :data:`FEATURES`)."""
    return [1.0, float(n > 0), float(n), float(c > 0), float(c), c * c / 1e3, x / 1e3, c * x / 1e6]


def nonnegative_least_squares(a: np.ndarray, b: np.ndarray, iterations: int = 200) -> np.ndarray:
    """``argmin ||a w - b||`` subject to ``w >= 0`` (Lawson and Hanson's active-set method)."""
    rows, cols = a.shape
    w = np.zeros(cols)
    passive = np.zeros(cols, dtype=bool)
    for _ in range(iterations):
        gradient = a.T @ (b - a @ w)
        candidates = ~passive & (gradient > 1e-12)
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, gradient, -np.inf))] = True
        while True:
            z = np.zeros(cols)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                w = z
                break
            shrinking = passive & (z <= 0)
            step = np.min(w[shrinking] / (w[shrinking] - z[shrinking]))
            w = w + step * (z - w)
            passive &= w > 1e-15
    return w


@dataclass
class StepCostModel:
    """``T(n, c, x)`` in seconds (see the module docstring). ``weights`` follow :data:`FEATURES`."""

    weights: list[float]
    source: str = "fitted"
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.weights) != len(FEATURES) or any(w < 0 for w in self.weights):
            raise ValueError(f"a step cost model has {len(FEATURES)} non-negative weights, got {self.weights}")

    def __call__(self, num_decodes: int, prefill_tokens: int, context_tokens: int = 0) -> float:
        return float(np.dot(self.weights, features(num_decodes, prefill_tokens, context_tokens)))

    @classmethod
    def synthetic(cls) -> StepCostModel:
        """The SLOWeave paper's default step cost (no context term)."""
        ms = 1e-3
        return cls([0.35 * ms, 0.90 * ms, 0.055 * ms, 0.40 * ms, 0.006 * ms, 0.0, 0.0, 0.0], source="synthetic")

    @classmethod
    def fit(cls, shapes: list[tuple[int, int, int]], seconds: list[float], **meta) -> StepCostModel:
        """Fit on measured steps: ``shapes`` of ``(n, c, x)``, their times in seconds.

        Each row is weighted by ``1 / sqrt(seconds)``: between relative error (what a deadline
        feels: a 1 ms miss on a 2 ms step is worse than on a 50 ms one) and absolute error
        (what capacity feels: the big steps' time adds up)."""
        if len(shapes) < len(FEATURES):
            raise ValueError(f"fitting a step cost model needs at least {len(FEATURES)} measured steps, "
                             f"got {len(shapes)}")
        a = np.array([features(*shape) for shape in shapes])
        b = np.array(seconds, dtype=float)
        scale = 1.0 / np.sqrt(np.maximum(b, 1e-6))
        return cls(nonnegative_least_squares(a * scale[:, None], b * scale).tolist(), **meta)

    def relative_errors(self, shapes: list[tuple[int, int, int]], seconds: list[float]) -> list[float]:
        """``|T(shape) - measured| / measured`` per step."""
        return [abs(self(*shape) - measured) / measured for shape, measured in zip(shapes, seconds)]

    def to_json(self) -> dict:
        return {"formula": "T(n, c, x) = sum(weight_i * feature_i), seconds", "features": list(FEATURES),
                "weights": self.weights, "source": self.source, **self.meta}

    def save(self, path: str | Path) -> Path:
        """Write atomically (:func:`.atomic_file.write_atomically`)."""
        return write_atomically(path, json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> StepCostModel:
        """Read a model written by :meth:`save` (``preft eval profile``); one clear error otherwise."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"cannot read the step cost model {path}: {err}") from None
        return cls.from_json(data, str(path))

    @classmethod
    def from_json(cls, data, where: str = "the data") -> StepCostModel:
        """The model :meth:`to_json` wrote (``where`` names it in the error if it is not one)."""
        if not isinstance(data, dict) or data.get("features") != list(FEATURES) or "weights" not in data:
            raise ValueError(f"{where} is not a step cost model from `preft eval profile` "
                             f"(expected features {list(FEATURES)})")
        meta = {k: v for k, v in data.items() if k not in ("formula", "features", "weights", "source")}
        return cls([float(w) for w in data["weights"]], source=data.get("source", "fitted"), meta=meta)
