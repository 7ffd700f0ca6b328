"""The native host path of a float32 Qwen3 target (or a Llama, Qwen2, Mistral one: the same layer without q / k
norms, with a q / k / v bias): all decoder layers in one ``_core.HostQwen3Stack`` call.

On the host a verify of a few tokens is mostly fixed cost: about sixty small torch operators per layer (norms,
RoPE, the KV write, masks, attention, SiLU) cost more than the arithmetic. The core runs each layer
(``HostQwen3Layer``) over weights packed once (``host_linear``: bf16 panels when they hold the weights exactly),
one token at a time in a fixed order, so verifying T tokens gives each token the values that decoding it alone
would. The stack runs them all and copies the drafter's feature layers out in the same call: from Python, a
call per layer cost about 40 us (right after a verify evicted the caches), a tenth of a layer.

``Qwen3ForCausalLM.forward`` uses it for float32 CPU inference with a KV cache; training, other dtypes and
devices keep the torch path. The packed copies follow the parameters: a layer is repacked when any of its
weights changes (in place, or a new tensor).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from dpara_rt import _core
from dpara_rt.host import linear as host_linear
from dpara_rt.host.linear import pack_weight, registrations

__all__ = ["HostQwen3", "usable"]


def usable(model: nn.Module, h: Tensor, cache) -> bool:
    """Whether this forward can take the native layers: float32 on the CPU, a KV cache, nothing to train."""
    return (host_linear.native_target() and cache is not None and h.dtype == torch.float32
            and h.device.type == "cpu"
            and cache.k.dtype == torch.float32 and cache.k.stride(-1) == 1
            and cache.k.stride(-2) == cache.k.shape[-1]
            and not (torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters())))


def _layer_tensors(layer: nn.Module) -> list[Tensor]:
    """The 7 projections' weights, the 2 norms', then the q / k norms' where the layer has them (Qwen3) and the
    q / k / v biases where it has them (Qwen2)."""
    attn = layer.self_attn
    mlp = layer.mlp if isinstance(getattr(layer, "mlp", None), nn.Module) else layer  # the drafter's layer holds its MLP
    tensors = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight,
               mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight,
               layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    if isinstance(getattr(attn.q_norm, "weight", None), Tensor):
        tensors += [attn.q_norm.weight, attn.k_norm.weight]
    if attn.q_proj.bias is not None:
        tensors += [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
    return tensors


def _versions(tensors) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t._version) for t in tensors]


def _layer_math(layer: nn.Module) -> str:
    """The layer's host math (set_host_math's): its query projection's."""
    return getattr(layer.self_attn.q_proj, "host_math", "float32")


class _PackedLayer:
    """One layer's packed projections and norm weights, and the core object pointing at them. It holds the
    parameters it was packed from, so their identity, storage and version say whether it is still current, and
    the math it was packed for."""

    def __init__(self, tensors: list[Tensor], math: str):
        self.tensors, self.versions, self.registrations = tensors, _versions(tensors), registrations()
        self.math = math
        q, k, v, o, gate, up, down = (t.detach() for t in tensors[:7])
        packs = [pack_weight(w, math) for w in (torch.cat([q, k, v]), o, torch.cat([gate, up]), down)]
        extra = tensors[9:]
        qk_norms = [t.detach().contiguous() for t in extra[:2]] if len(extra) in (2, 5) else []
        bias = [torch.cat([t.detach() for t in extra[-3:]]).contiguous()] if len(extra) >= 3 else []
        self.norms = [t.detach().contiguous() for t in tensors[7:9]] + qk_norms + bias  # held: the core points at them
        self.packed = [p for p, _ in packs]
        q_norm, k_norm = (n.data_ptr() for n in qk_norms) if qk_norms else (0, 0)
        self.core = _core.HostQwen3Layer(*(p.data_ptr() for p in self.packed), [dt for _, dt in packs],
                                         *(n.data_ptr() for n in self.norms[:2]), q_norm=q_norm, k_norm=k_norm,
                                         qkv_bias=bias[0].data_ptr() if bias else 0)

    def unchanged(self) -> bool:
        """Nothing registered since packing (no parameter or module replaced) and the same storage and versions."""
        return self.registrations == registrations() and self.versions == _versions(self.tensors)

    def current(self, tensors: list[Tensor], math: str) -> bool:
        return (len(self.tensors) == len(tensors) and all(a is b for a, b in zip(self.tensors, tensors))
                and self.versions == _versions(tensors)
                and self.math == math)


class VerifyPlan:
    """A decode's verify as one core call (``HostQwen3Verify.run``), with every buffer it points at held here: the
    packed layers and the stack, the embedding, RoPE tables, final norm and output head, the KV cache."""

    def __init__(self, core, keep: tuple, features_width: int, vocab: int):
        self.core, self._keep = core, keep
        self.features_width, self.vocab = features_width, vocab


class HostQwen3:
    """The native layers of one ``Qwen3ForCausalLM``, packed on first use. Copies and pickles of the model
    start without them (the core objects hold raw pointers) and pack again when first used."""

    def __init__(self):
        self._layers: dict[int, _PackedLayer] = {}
        self._stack: tuple | None = None  # (what it was built for, _core.HostQwen3Stack)

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.__init__()

    def packed(self, i: int, layer: nn.Module) -> _PackedLayer:
        got = self._layers.get(i)
        if got is not None and got.unchanged():
            return got
        tensors, math = _layer_tensors(layer), _layer_math(layer)  # something was registered: walk the modules
        if got is None or not got.current(tensors, math):
            got = self._layers[i] = _PackedLayer(tensors, math)
        got.registrations = registrations()
        return got

    def norm(self, norm: nn.Module, h: Tensor) -> Tensor:
        """The final RMSNorm of h [B, T, H] (float32, contiguous) as the native layers compute their norms: one
        core call where the torch module costs a handful of small ops."""
        w = norm.weight
        if w.dtype != torch.float32 or not w.is_contiguous() or not h.is_contiguous():
            return norm(h)
        out = torch.empty_like(h)
        _core.host_rms_norm(h.data_ptr(), w.data_ptr(), h.numel() // h.shape[-1], h.shape[-1], norm.eps,
                            out.data_ptr())
        return out

    def run_all(self, layers, cfg, h: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, cache,
                capture: dict[int, int], features: Tensor | None, recheck: bool = True) -> None:
        """Every layer over h [B * T, H] (float32, contiguous, updated in place) at positions [B, T] (int64,
        contiguous), cos / sin [B * T, head_dim], in one core call; h after layer i copied into features
        [B * T, F] at column capture[i], but the last layer's (it is taken after the final norm, by the caller).
        recheck=False: see _stack_for."""
        stack = self._stack_for(layers, cache, _layer_columns(capture, len(layers))[0], recheck)
        B, T = positions.shape
        stack.forward(*_dims(cfg), h.data_ptr(), B, T, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                      0 if features is None else features.data_ptr(), 0 if features is None else features.shape[-1])

    def run_tokens(self, layers, cfg, ends: tuple, tokens: Tensor, positions: Tensor, cache, capture: dict[int, int],
                   features: Tensor | None, logits: Tensor, recheck: bool = True) -> None:
        """A whole forward in one core call (``host_qwen3_tokens``): tokens and positions [B, T] (int64, contiguous),
        ends = (embedding [V, H], RoPE tables cos / sin [n, head_dim] covering every position, final norm weight
        and eps, the output head as HostLinear.packed gives it), logits [B, T, V'] (float32, contiguous); h after
        layer i copied into features [B * T, F] at column capture[i] (the last layer's after the final norm).
        recheck=False: see _stack_for."""
        cols, last_capture = _layer_columns(capture, len(layers))
        stack = self._stack_for(layers, cache, cols, recheck)
        B, T = tokens.shape
        stack.tokens_forward(*_dims(cfg), *_ends_args(ends), logits.shape[-1], tokens.data_ptr(), B, T,
                             positions.data_ptr(), last_capture, 0 if features is None else features.data_ptr(),
                             0 if features is None else features.shape[-1], logits.data_ptr())

    def verify_plan(self, layers, cfg, ends: tuple, cache, capture: dict[int, int], features_width: int,
                    head_vocab: int) -> "VerifyPlan":
        """A decode's verify bound once (``host_qwen3_verify``): ends and capture as run_tokens's, the positions read
        from cache.lengths at each run. Trusts the layers as the last check found them (recheck=False): the caller
        builds it right after a forward that checked them."""
        cols, last_capture = _layer_columns(capture, len(layers))
        stack = self._stack_for(layers, cache, cols, recheck=False)
        core = stack.verify_plan(*_dims(cfg), *_ends_args(ends), head_vocab, last_capture, features_width,
                                 cache.lengths.data_ptr())
        return VerifyPlan(core, (self._stack, ends, cache), features_width, head_vocab)

    def run_block(self, layers, cfg, final_norm: Tensor, h: Tensor, ctx_lens: Tensor, visible: Tensor, cos: Tensor,
                  sin: Tensor, cache, keep_from: int) -> Tensor:
        """A drafter's backbone over blocks of rows in one core call (``host_block_layers``): h [B, T, H] (float32,
        contiguous; overwritten) attends to the first ctx_lens[b] (int64 [B]) slots of the context cache and to its
        block's rows through visible [T, T] or [B, T, T] (uint8, contiguous); cos / sin [B * T, head_dim]. Returns
        the final-normed rows keep_from.. of each block, [B, T - keep_from, H]."""
        stack = self._stack_for(layers, cache, [-1] * len(layers))
        B, T, H = h.shape
        out = torch.empty(B, T - keep_from, H)
        stack.block_forward(*_dims(cfg), h.data_ptr(), B, T, ctx_lens.data_ptr(), visible.data_ptr(),
                            0 if visible.dim() == 2 else T * T, cos.data_ptr(), sin.data_ptr(), keep_from,
                            final_norm.data_ptr(), out.data_ptr())
        return out

    def run_context(self, layers, cfg, fc: tuple[Tensor, str], context_norm: Tensor, features: Tensor,
                    lengths: Tensor, counts: Tensor, cos: Tensor, sin: Tensor, cache) -> None:
        """A drafter's context update in one core call (``host_context_kv``): the first counts[b] rows of
        features [B, T, F] (float32, contiguous) fused (fc: packed, dtype name; then the RMSNorm weight
        context_norm) and every layer's K/V of them written at slots lengths[b] + j of the context cache (lengths,
        counts int64 [B]); cos / sin [B * T, head_dim] at those positions."""
        stack = self._stack_for(layers, cache, [-1] * len(layers))
        B, T, F = features.shape
        packed, dtype = fc
        stack.context_forward(*_dims(cfg), packed.data_ptr(), dtype, F, context_norm.data_ptr(), features.data_ptr(),
                              B, T, lengths.data_ptr(), counts.data_ptr(), cos.data_ptr(), sin.data_ptr())

    def _stack_for(self, layers, cache, cols: list[int], recheck: bool = True):
        """The core object over these layers and this cache, rebuilt when a layer is repacked or the cache or the
        capture changes. recheck=False trusts the layers as the last check found them (the caller knows that
        nothing changed them since: the engine's verifies within one decode) and checks only the cache and the
        capture."""
        k, v = cache.k, cache.v  # [layers, rows, kv_heads, max_len, head_dim], v laid out as k
        where = (k.data_ptr(), v.data_ptr(), k.stride(), v.stride(), k.shape, cols)
        if not recheck and self._stack is not None and self._stack[0][1:] == where:
            return self._stack[1]
        packed = [self.packed(i, layer) for i, layer in enumerate(layers)]
        key = (packed, *where)
        if self._stack is None or self._stack[0] != key:
            if v.stride() != k.stride():
                raise ValueError(f"KV cache v strides {v.stride()} differ from k's {k.stride()}; expected one layout")
            self._stack = key, _core.HostQwen3Stack([p.core for p in packed], k.data_ptr(), v.data_ptr(), k.stride(0),
                                                    k.stride(1), k.stride(2), k.shape[3], cols)
        return self._stack[1]


def _layer_columns(capture: dict[int, int], n_layers: int) -> tuple[list[int], int]:
    """(the core's capture column per layer, -1 for none and for the last layer; the last layer's column, or -1): the
    last layer's feature is its output after the final norm, which the core writes after the stack."""
    last = n_layers - 1
    return [capture.get(i, -1) if i != last else -1 for i in range(n_layers)], capture.get(last, -1)


def _ends_args(ends: tuple) -> tuple:
    """The core's arguments for the ends of a whole forward (embedding, RoPE tables, final norm, packed head)."""
    embed, cos, sin, norm, eps, (packed, dtype) = ends
    return (embed.data_ptr(), embed.shape[0], cos.data_ptr(), sin.data_ptr(), len(cos), norm.data_ptr(), eps,
            packed.data_ptr(), dtype)


def _dims(cfg) -> tuple:
    return (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size,
            cfg.rms_norm_eps)
