"""PreFT's SGLang plugin: entry point ``sglang.srt.plugins`` (``preft``), run by SGLang's
``load_plugins()`` in each of its processes before the Scheduler is built (``preft serve
--engine sglang`` sets ``SGLANG_PLUGINS=preft``, so no other plugin loads).

With ``PREFT_SCHEDULER`` naming an admission order (``--scheduler feather``), two hooks go into
SGLang's ``HookRegistry``, both AROUND:

- ``Scheduler.get_new_batch_prefill``: SGLang admits from the requests the order picks, in its
  order (:func:`.waiting_order.admit_in_order`);
- ``Scheduler.run_batch``: each step's time goes to the order (:func:`.waiting_order.reward`).

With a SLOWeave chunk policy (``--scheduler sloweave --tpot-ms MS``, SGLang in mixed-chunk
mode), the same two hooks set SGLang's prefill chunk each step from the policy and feed each
step's time to its online cost model (:mod:`.chunk_control`).

With ``PREFT_SGLANG_LORA=1`` (``preft serve --engine sglang --adapter ...``), LoRA-P's hooks
(:mod:`.lora_p`): each adapter's rule read as SGLang loads it, a prefill-only adapter's prefix
keys, the step's token mask, and SGLang's LoRA A product masked by it.

With ``PREFT_SCHEDULING_COST=FILE`` (``preft eval sglang``) the same two hooks, and one on
SGLang's ``SchedulePolicy.calc_priority``, count what scheduling costs
(:mod:`.scheduling_cost`), under any policy.

The order is the same object vLLM and the simulator run
(:func:`preft.serving.scheduling.admission.admission_from_spec`), one per scheduler process.
Each hooked internal is checked to exist first, so an SGLang release that moved one fails at
start-up naming it (SGLang's own loader would only log the error and serve without the order).
"""

from __future__ import annotations

import functools
import logging
import pkgutil
import time

from preft import envs
from preft.serving.scheduling.spec import SchedulerSpec

logger = logging.getLogger(__name__)

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
HOOKS = ("get_new_batch_prefill", "run_batch")
#: SGLang's own waiting-queue ordering (timed with PREFT_SCHEDULING_COST)
POLICY_ORDER = "sglang.srt.managers.schedule_policy.SchedulePolicy.calc_priority"
#: what ``get_new_batch_prefill`` returns (a step given no prefill returns one with no batch)
BATCH_PLAN = "sglang.srt.managers.schedule_batch.NextBatchPlan"
#: LoRA-P's hooks (:mod:`.lora_p`; on with PREFT_SGLANG_LORA=1)
LORA_HOOKS = {"rule": "sglang.srt.lora.lora_manager.LoRAManager.load_lora_weights",
              "key": "sglang.srt.managers.schedule_batch.Req.__init__",
              "mask": "sglang.srt.lora.lora_manager.LoRAManager.prepare_lora_batch",
              "lora_a": "sglang.srt.lora.backend.torch_backend.sgemm_lora_a_fwd"}
#: SGLang's LoRA modules that ask torch for pinned memory by argument (:func:`.lora_p.allow_unpinned`)
UNPINNED_MODULES = ("sglang.srt.lora.layers", "sglang.srt.lora.backend.torch_backend")
#: the admission orders SGLang can run through the hooks (``fcfs``: SGLang's own queue, no hook)
SGLANG_ADMISSIONS = ("fcfs", "feather")
#: the prefill chunk policies (``default``: SGLang's own ``--chunked-prefill-size``, no hook)
SGLANG_CHUNK_POLICIES = ("default", "sloweave")


def sglang_internal(path: str):
    """The object at ``path`` in SGLang, or a RuntimeError saying which internal moved."""
    owner_path, _, name = path.rpartition(".")
    try:
        owner = pkgutil.resolve_name(owner_path)
    except (ImportError, AttributeError) as err:
        raise RuntimeError(f"SGLang internal {owner_path} moved ({err}): update preft.serving.sglang for this "
                           "SGLang release") from None
    if not hasattr(owner, name):
        raise RuntimeError(f"SGLang internal {path} moved: update preft.serving.sglang for this SGLang release")
    return getattr(owner, name)


def waiting_order_of(scheduler, spec: SchedulerSpec):
    """The scheduler's :class:`~.waiting_order.WaitingOrder`, made on first use."""
    state = getattr(scheduler, "preft_waiting_order", None)
    if state is None:
        from preft.serving.scheduling.admission import admission_from_spec
        from preft.serving.sglang.waiting_order import WaitingOrder

        state = scheduler.preft_waiting_order = WaitingOrder(admission_from_spec(spec))
        logger.info("preft: SGLang admits in %s order", spec.admission)
    return state


def chunk_control_of(scheduler, spec: SchedulerSpec):
    """The scheduler's :class:`~.chunk_control.ChunkControl`, made on first use."""
    control = getattr(scheduler, "preft_chunk_control", None)
    if control is None:
        from preft.serving.scheduling.chunk_policies import policy_from_spec
        from preft.serving.sglang.chunk_control import ChunkControl

        if not scheduler.is_mixed_chunk:
            raise RuntimeError(f"--scheduler {spec.name} sets the prefill chunk of steps that carry the running "
                               "decodes: SGLang needs --enable-mixed-chunk and a --chunked-prefill-size")
        control = scheduler.preft_chunk_control = ChunkControl(policy_from_spec(spec))
        logger.info("preft: SGLang's prefill chunk set each step by %s", spec.chunk_policy)
    return control


def register() -> None:
    spec = SchedulerSpec.from_json(envs.PREFT_SCHEDULER)
    if spec.admission not in SGLANG_ADMISSIONS or spec.chunk_policy not in SGLANG_CHUNK_POLICIES:
        raise ValueError(f"scheduler {spec.name} does not run on SGLang (it runs the admission orders "
                         f"{', '.join(SGLANG_ADMISSIONS)} and the chunk policies {', '.join(SGLANG_CHUNK_POLICIES)})")
    feather, cost_file, lora_p = spec.admission == "feather", envs.PREFT_SCHEDULING_COST, envs.PREFT_SGLANG_LORA
    chunking = spec.chunk_policy != "default"
    if not feather and not chunking and not cost_file and not lora_p:
        return  # SGLang's own queue and chunks, nothing measured, no adapters: no hook
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from preft.serving.sglang import lora_p as lora_rule
    from preft.serving.sglang.chunk_control import sized_prefill
    from preft.serving.sglang.scheduling_cost import SchedulingCost
    from preft.serving.sglang.waiting_order import admit_in_order, reward

    try:
        for target in (*(f"{SCHEDULER}.{name}" for name in HOOKS), POLICY_ORDER, BATCH_PLAN, *LORA_HOOKS.values()):
            sglang_internal(target)
        plan_class = sglang_internal(BATCH_PLAN)
    except RuntimeError as err:  # SystemExit passes SGLang's loader, which would log an Exception and go on
        logger.critical("preft: %s", err)
        raise SystemExit(f"preft: {err}") from None
    cost = SchedulingCost(cost_file) if cost_file else None

    def admit(original, scheduler, *args, **kwargs):
        running_batch = args[0] if args else kwargs["running_batch"]
        queued = bool(scheduler.waiting_queue)  # a pass with nothing waiting orders nothing: not counted
        state = waiting_order_of(scheduler, spec) if feather else None
        before = state.own_s if state else 0.0
        inner = functools.partial(admit_in_order, original) if feather else original
        if chunking:
            result = sized_prefill(inner, scheduler, running_batch, chunk_control_of(scheduler, spec), plan_class)
        else:
            result = inner(scheduler, running_batch)
        if cost and queued:
            cost.add(admissions=1, preft_order_s=(state.own_s - before) if state else 0.0)
        return result

    def run_batch(original, scheduler, batch, *args, **kwargs):
        if lora_p:
            lora_rule.remember_prompt_lengths(batch)
        started = time.perf_counter()
        result = original(scheduler, batch, *args, **kwargs)
        step_s = time.perf_counter() - started
        if chunking:
            control = chunk_control_of(scheduler, spec)
            now = time.monotonic()
            control.record(batch, control.pass_started_s or now - step_s, now)
        if feather:
            reward(waiting_order_of(scheduler, spec), batch, step_s)
        if cost:
            cost.add(steps=1, step_s=step_s)
        return result

    def sglang_order(original, *args, **kwargs):
        started = time.perf_counter()
        result = original(*args, **kwargs)
        cost.add(sglang_order_s=time.perf_counter() - started)
        return result

    HookRegistry.register(f"{SCHEDULER}.get_new_batch_prefill", admit, HookType.AROUND)
    HookRegistry.register(f"{SCHEDULER}.run_batch", run_batch, HookType.AROUND)
    if cost:
        HookRegistry.register(POLICY_ORDER, sglang_order, HookType.AROUND)
    if lora_p:
        import importlib

        lora_rule.allow_unpinned([importlib.import_module(name) for name in UNPINNED_MODULES])
        HookRegistry.register(LORA_HOOKS["rule"], lora_rule.remember_rule, HookType.AFTER)
        HookRegistry.register(LORA_HOOKS["key"], lora_rule.prefix_key, HookType.AFTER)
        HookRegistry.register(LORA_HOOKS["mask"], lora_rule.mask_for_step, HookType.AFTER)
        HookRegistry.register(LORA_HOOKS["lora_a"], lora_rule.masked_lora_a, HookType.AROUND)
