"""vLLM's general plugin for DPara (entry point ``dpara`` in the group ``vllm.general_plugins``): lets a vLLM user
name the method,

    LLM(model=target_dir, speculative_config={"method": "dpara", "model": drafter_dir, "num_speculative_tokens": 7})

vLLM checks ``speculative_config["method"]`` against a fixed list of its own methods, so ``register`` wraps
``EngineArgs.create_speculative_config`` (one method, in the process that builds the engine's config) to rewrite
"dpara" into what vLLM supports already: its custom proposer class (``dpara_rt.engines.vllm.DParaProposer``),
with the drafter directory moved into ``additional_config["dpara_drafter"]``. Nothing else of vLLM changes, and
this module imports nothing heavy: vLLM runs it in every one of its processes.
"""
from __future__ import annotations

import functools

METHOD = "dpara"
PROPOSER = "dpara_rt.engines.vllm.DParaProposer"


def register() -> None:
    """Run by vLLM in each of its processes: wrap ``EngineArgs.create_speculative_config`` (idempotent; a vLLM
    without it is left alone, and a "dpara" request then fails in vLLM's own check)."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return
    original = getattr(EngineArgs, "create_speculative_config", None)
    if original is None or getattr(original, "dpara_method", False):
        return

    @functools.wraps(original)
    def create_speculative_config(self, *args, **kwargs):
        translate(self)
        return original(self, *args, **kwargs)

    create_speculative_config.dpara_method = True
    EngineArgs.create_speculative_config = create_speculative_config


def translate(args) -> None:
    """Rewrite an EngineArgs' ``method: "dpara"`` (in speculative_config, or the ``--spec-method`` alias) into
    vLLM's custom proposer; any other method is left as it is. The drafter comes from ``model`` (or
    ``--spec-model``), else from ``additional_config["dpara_drafter"]``."""
    spec = dict(args.speculative_config or {})
    alias_method, alias_model = getattr(args, "spec_method", None), getattr(args, "spec_model", None)
    if spec.get("method", alias_method) != METHOD:
        return
    from dpara_rt.engines.vllm import check_vllm_version

    check_vllm_version()
    drafter = spec.get("model", alias_model)
    extra = dict(args.additional_config or {})
    given = extra.get("dpara_drafter")
    if drafter is None and given is None:
        raise ValueError('speculative_config {"method": "dpara"} names no drafter; expected "model": the drafter\'s '
                         "directory (or additional_config['dpara_drafter'])")
    if drafter is not None and given is not None and str(given) != str(drafter):
        raise ValueError(f"the drafter is named twice: speculative_config model {drafter!r} and "
                         f"additional_config['dpara_drafter'] {given!r}; expected one of them")
    if drafter is not None:
        extra["dpara_drafter"] = drafter
    spec.update(method="custom_class", model=PROPOSER)
    args.spec_method = args.spec_model = None  # moved into the dict, which vLLM takes with its aliases unset
    args.speculative_config, args.additional_config = spec, extra


__all__ = ["METHOD", "PROPOSER", "register", "translate"]
