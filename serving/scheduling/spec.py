"""What ``--scheduler`` names, parsed once: :class:`SchedulerSpec`.

A scheduler name is a prefill chunk policy and/or an admission order joined by ``+``, either
part optional, in any order (:data:`SCHEDULER_CHOICES`):

    feather+sloweave  ->  admission "feather", chunk policy "sloweave"
    fixed:256         ->  admission "fcfs",    chunk policy "fixed:256"
    sloweave+wavepp   ->  admission "fcfs",    chunk policy "sloweave+wavepp" (a deadline budget per
                                               step, pipeline-sized chunks inside it)

The spec also holds the policies' settings (SLOWeave's ``tpot_ms``, ``cost_model`` (the
online cost model's seed), ``cost_state`` (where it keeps what it learned), ``max_chunk``,
``margin_ms``; WavePP's ``min_chunk`` and ``stages``; Feather's
``feather_state`` and ``feather_max_wait_s``). ``preft serve`` builds it from its flags
(:func:`preft.serving.server.scheduler_spec`) and hands it to the engine as ``PREFT_SCHEDULER``
(:meth:`SchedulerSpec.to_json`); the engine's :class:`~preft.serving.scheduler.PreftScheduler`
and the simulator build their policies from it
(:func:`~preft.serving.scheduling.chunk_policies.policy_from_spec`,
:func:`~preft.serving.scheduling.admission.admission_from_spec`).

>>> spec = SchedulerSpec.parse("sloweave+feather", tpot_ms=25, cost_model="cost.json")
>>> spec.admission, spec.chunk_policy, spec.sloweave, spec.wavepp
('feather', 'sloweave', True, False)
>>> SchedulerSpec.from_json(spec.to_json()) == spec
True
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields, replace

ADMISSIONS = ("fcfs", "lpm", "feather", "groups")
#: the admission orders that rank requests by their prefix-cache blocks (they need prefix caching)
PREFIX_ADMISSIONS = ("lpm", "feather")
#: the prefill chunk policies by the form of their names (``cycle:`` is ``preft eval profile``'s)
CHUNK_POLICY_NAMES = re.compile(r"default|fixed:\d+|cycle:\d+(,\d+)*|sloweave|wavepp|sloweave\+wavepp")
#: what ``--scheduler`` takes, for its help and its errors
SCHEDULER_CHOICES = ("a prefill chunk policy (default, fixed:TOKENS, sloweave, wavepp, sloweave+wavepp; "
                     "cycle:TOKENS,TOKENS,... for profiling) and/or an admission order (fcfs, lpm, feather, groups), "
                     "joined by '+', e.g. feather+sloweave")


def split_scheduler_name(name: str) -> tuple[str, str]:
    """``ADMISSION+CHUNK_POLICY`` (either part optional, in any order) -> (admission, chunk policy):
    ``feather`` -> (feather, default); ``feather+sloweave`` -> (feather, sloweave);
    ``fixed:256`` -> (fcfs, fixed:256); ``feather+sloweave+wavepp`` -> (feather, sloweave+wavepp)."""
    if not isinstance(name, str):
        raise ValueError(f"scheduler name must be a string, got {name!r}")
    parts = name.split("+")
    if any(not part for part in parts):
        raise ValueError(f"scheduler {name!r}: an empty part (expected e.g. feather+sloweave)")
    admissions = [part for part in parts if part in ADMISSIONS]
    chunks = [part for part in parts if part not in ADMISSIONS]
    if sorted(chunks) == ["sloweave", "wavepp"]:
        chunks = ["sloweave+wavepp"]
    if len(admissions) > 1 or len(chunks) > 1:
        raise ValueError(f"scheduler {name!r}: at most one admission order and one prefill chunk policy; "
                         f"expected {SCHEDULER_CHOICES}")
    chunk = (chunks or ["default"])[0]
    if not CHUNK_POLICY_NAMES.fullmatch(chunk):
        raise ValueError(f"unknown scheduler {name!r}" + (f" (its part {chunk!r})" if chunk != name else "")
                         + f": expected {SCHEDULER_CHOICES}")
    return (admissions or ["fcfs"])[0], chunk


@dataclass(frozen=True)
class SchedulerSpec:
    """A parsed ``--scheduler`` and its settings (see the module docstring); its admission order
    and chunk policy are read off the name. Build it with :meth:`parse` or :meth:`from_json`,
    which check every field."""

    name: str = "default"
    tpot_ms: float | None = None  # SLOWeave's TPOT target
    cost_model: str | None = None  # a step cost model file that seeds SLOWeave's and WavePP's online model
    cost_state: str | None = None  # the online model's state file (read at start, written as it learns)
    max_chunk: int = 2048
    margin_ms: float = 0.0
    min_chunk: int = 16  # WavePP's
    stages: int = 1  # WavePP's pipeline stages (the engine's pipeline-parallel size)
    feather_state: str | None = None
    feather_max_wait_s: float | None = None

    @property
    def admission(self) -> str:
        """The admission order the name gives (``fcfs`` when it names none)."""
        return split_scheduler_name(self.name)[0]

    @property
    def chunk_policy(self) -> str:
        """The prefill chunk policy the name gives (``default`` when it names none)."""
        return split_scheduler_name(self.name)[1]

    @property
    def sloweave(self) -> bool:
        """Whether the chunk policy meets decode deadlines (SLOWeave, alone or with WavePP)."""
        return self.chunk_policy in ("sloweave", "sloweave+wavepp")

    @property
    def wavepp(self) -> bool:
        """Whether the chunk policy sizes chunks for pipeline stages (WavePP, alone or with SLOWeave)."""
        return self.chunk_policy in ("wavepp", "sloweave+wavepp")

    @property
    def largest_chunk(self) -> int:
        """The most prefill tokens one step may give a request under this policy."""
        if ":" in self.chunk_policy:
            return max(int(size) for size in self.chunk_policy.split(":", 1)[1].split(","))
        return self.max_chunk

    @classmethod
    def parse(cls, name: str = "default", **settings) -> SchedulerSpec:
        """The spec of ``name`` with ``settings`` (the fields after ``name``), checked."""
        unknown = set(settings) - SETTINGS
        if unknown:
            raise ValueError(f"scheduler spec: unknown key(s) {sorted(unknown)} (known: {', '.join(sorted(SETTINGS))})")
        admission = split_scheduler_name(name)[0]  # a bad name fails here
        settings = {key: value for key, value in settings.items() if value is not None}
        for key, low in (("tpot_ms", "> 0"), ("margin_ms", ">= 0"), ("feather_max_wait_s", "> 0"),
                         ("max_chunk", "> 0"), ("min_chunk", "> 0"), ("stages", "> 0")):
            value = settings.get(key)
            if value is None:
                continue
            integral = key in ("max_chunk", "min_chunk", "stages")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (integral and value != int(value)) \
                    or not math.isfinite(value) or not (value > 0 if low == "> 0" else value >= 0):
                raise ValueError(f"scheduler spec: {key} must be {'an integer' if integral else 'a number'} {low}, "
                                 f"got {value!r}")
            settings[key] = int(value) if integral else float(value)
        for key in ("cost_model", "cost_state", "feather_state"):
            if key in settings and not isinstance(settings[key], str):
                raise ValueError(f"scheduler spec: {key} must be a file name, got {settings[key]!r}")
        if admission != "feather" and ("feather_state" in settings or "feather_max_wait_s" in settings):
            raise ValueError(f"the Feather state and age bound are Feather's; scheduler {name!r} has none")
        return cls(name=name, **settings)

    @classmethod
    def from_json(cls, data: dict) -> SchedulerSpec:
        """A spec from ``PREFT_SCHEDULER``'s JSON object (``{}``: vLLM's own scheduling)."""
        if not isinstance(data, dict):
            raise ValueError(f"scheduler spec must be a JSON object, got {type(data).__name__}")
        data = dict(data)
        return cls.parse(data.pop("name", "default"), **data)

    def to_json(self) -> dict:
        """What :meth:`from_json` reads back: the name and the settings that are set (WavePP's
        ``min_chunk`` and ``stages`` only for a WavePP policy, which alone reads them)."""
        skipped = set() if self.wavepp else {"min_chunk", "stages"}
        return {key: value for key, value in asdict(self).items() if key not in skipped and value is not None}

    def with_stages(self, stages: int) -> SchedulerSpec:
        return replace(self, stages=stages)


#: the settings a spec may carry besides its name (``PREFT_SCHEDULER``'s keys, with ``name``)
SETTINGS = frozenset(f.name for f in fields(SchedulerSpec)) - {"name"}
