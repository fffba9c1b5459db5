"""Slow, obviously-correct references: explicit softmax, full score matrices.

Everything here materialises the N x M (or N x N) scores; it is only for tests.
"""

from __future__ import annotations

import math

import torch

from flarepp.ops import AttentionBackend


def _scale(d: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(d) if scale is None else scale


def masked_softmax(scores: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim, masked keys excluded; all-masked rows give zeros."""
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.nan_to_num(probs, nan=0.0)


def explicit_encode(q, k, v, mask=None, *, scale=None):
    """Z = softmax_N(s Q K^T) V, [B, H, M, D]."""
    s = _scale(q.shape[-1], scale)
    key_mask = None if mask is None else mask[:, None, None, :]
    return masked_softmax(s * q @ k.transpose(-1, -2), key_mask) @ v


def explicit_encode_lse(q, k, v, mask=None, *, scale=None):
    s = _scale(q.shape[-1], scale)
    scores = s * q @ k.transpose(-1, -2)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    return explicit_encode(q, k, v, mask, scale=scale), torch.logsumexp(scores, dim=-1)


def explicit_decode(k, q, z, mask=None, *, scale=None):
    """Y = softmax_M(s K Q^T) Z with masked tokens' rows zero, [B, H, N, D]."""
    s = _scale(q.shape[-1], scale)
    y = torch.softmax(s * k @ q.transpose(-1, -2), dim=-1) @ z
    return y if mask is None else y * mask[:, None, :, None]


def explicit_self_attention(q, k, v, mask=None, *, scale=None):
    s = _scale(q.shape[-1], scale)
    key_mask = None if mask is None else mask[:, None, None, :]
    y = masked_softmax(s * q @ k.transpose(-1, -2), key_mask) @ v
    return y if mask is None else y * mask[:, None, :, None]


class ExplicitBackend(AttentionBackend):
    """Every attention call by explicit softmax: the reference for any registered mixer."""

    name = "explicit"

    def encode(self, q, k, v, mask=None, *, scale=None):
        return explicit_encode(q, k, v, mask, scale=scale)

    def decode(self, k, q, z, mask=None, *, scale=None):
        return explicit_decode(k, q, z, mask, scale=scale)

    def self_attention(self, q, k, v, mask=None, *, scale=None):
        return explicit_self_attention(q, k, v, mask, scale=scale)


# ----------------------------------------------------------------------------------------
# Table 2, written out op by op from the paper, reading the mixers' parameters.
# ----------------------------------------------------------------------------------------

def _heads(x_BNC, H):
    B, N, C = x_BNC.shape
    return x_BNC.reshape(B, N, H, C // H).permute(0, 2, 1, 3)


def _unheads(y_BHND):
    B, H, N, D = y_BHND.shape
    return y_BHND.permute(0, 2, 1, 3).reshape(B, N, H * D)


def _lin(x, weight, bias):
    return x @ weight.T + (0 if bias is None else bias)


def _norm(module, t):
    """Apply a per-head norm explicitly (LayerNorm / RMSNorm over D, optional scale)."""
    norm = module.norm
    if isinstance(norm, torch.nn.LayerNorm):
        mu = t.mean(-1, keepdim=True)
        var = ((t - mu) ** 2).mean(-1, keepdim=True)
        out = (t - mu) / torch.sqrt(var + norm.eps)
        if norm.weight is not None:
            out = out * norm.weight + norm.bias
        return out
    eps = norm.eps
    out = t / torch.sqrt((t ** 2).mean(-1, keepdim=True) + eps)
    return out if norm.weight is None else out * norm.weight


def _split_weights(linear, k):
    W = linear.weight.chunk(k, dim=0)
    b = linear.bias.chunk(k, dim=0) if linear.bias is not None else [None] * k
    return list(zip(W, b))


def reference_mixer(name: str, mixer, x, mask=None):
    """The mixer's output per paper Table 2 with explicit softmaxes."""
    c = mixer.config
    H, s = c.heads, c.attn_scale
    if mask is not None:
        x = x * mask[..., None]
    B = x.shape[0]
    out_w, out_b = mixer.out_proj.weight, mixer.out_proj.bias
    if name == "attention":
        (wq, _), (wk, _), (wv, _) = _split_weights(mixer.qkv_proj, 3)
        q, k, v = (_heads(_lin(x, w, None), H) for w in (wq, wk, wv))
        y = explicit_self_attention(q, k, v, mask, scale=s)
        out = _lin(_unheads(y), out_w, out_b)
        return out if mask is None else out * mask[..., None]
    if name == "flare":
        (wk, bk), (wv, bv) = _split_weights(mixer.key_value_proj, 2)
        K, V = _heads(_lin(x, wk, bk), H), _heads(_lin(x, wv, bv), H)
        Q = mixer.fixed_queries.unsqueeze(0).expand(B, -1, -1, -1)
    elif name == "flarepp":
        (wsk, bsk), (wk, bk), (wv, bv) = _split_weights(mixer.key_value_proj, 3)
        Kt = _norm(mixer.synthesis_key_norm, _heads(_lin(x, wsk, bsk), H))       # N_0
        seeds = _norm(mixer.seed_norm, mixer.synthesis_seeds).expand(B, -1, -1, -1)  # N_a
        Qd = explicit_encode(seeds, Kt, Kt, mask, scale=s)
        Qf = _norm(mixer.fixed_query_norm, mixer.fixed_queries)                  # N_0
        Q = Qf + torch.sigmoid(mixer.gate_logit).view(1, H, 1, 1) * Qd
        K = _norm(mixer.routing_key_norm, _heads(_lin(x, wk, bk), H))            # N_a
        V = _heads(_lin(x, wv, bv), H)
    elif name in ("flarepp-simple", "flarepp-v1"):
        (wsk, bsk), (wsv, bsv), (wk, bk), (wv, bv) = _split_weights(mixer.key_value_proj, 4)
        Kt = _heads(_lin(x, wsk, bsk), H)
        seeds = mixer.synthesis_seeds.expand(B, -1, -1, -1)
        if name == "flarepp-simple":
            Kt, seeds = _norm(mixer.synthesis_key_norm, Kt), _norm(mixer.seed_norm, seeds)
        Q = explicit_encode(seeds, Kt, _heads(_lin(x, wsv, bsv), H), mask, scale=s)
        K, V = _heads(_lin(x, wk, bk), H), _heads(_lin(x, wv, bv), H)
    else:
        raise KeyError(name)
    Z = explicit_encode(Q, K, V, mask, scale=s)
    Y = explicit_decode(K, Q, Z, mask, scale=s)
    out = _lin(_unheads(Y), out_w, out_b)
    return out if mask is None else out * mask[..., None]


def routing_matrix(name: str, mixer, x):
    """The induced N x N token routing matrix per head, [B, H, N, N] (no mask)."""
    captured = {}
    original = mixer.backend

    class Capture(ExplicitBackend):
        def decode(self, k, q, z, mask=None, *, scale=None):
            captured["k"], captured["q"] = k, q
            return super().decode(k, q, z, mask, scale=scale)

    mixer.backend = Capture()
    try:
        mixer(x)
    finally:
        mixer.backend = original
    k, q = captured["k"], captured["q"]
    s = _scale(q.shape[-1], mixer.config.attn_scale)
    scores = s * q @ k.transpose(-1, -2)              # [B, H, M, N]
    encode_w = torch.softmax(scores, dim=-1)           # over N
    decode_w = torch.softmax(scores.transpose(-1, -2), dim=-1)  # [B, H, N, M], over M
    return decode_w @ encode_w


def assert_backend_parity(module, x, mask=None):
    """``module`` on the fused backend equals a copy on :class:`ExplicitBackend`: outputs
    and the gradients of the input and every parameter (float64, 1e-10)."""
    import copy

    from flarepp.ops import set_backend
    explicit = set_backend(copy.deepcopy(module), ExplicitBackend())
    outs, grads = [], []
    for m in (module, explicit):
        xi = x.clone().requires_grad_(True)
        y = m(xi, mask=mask)
        y.backward(torch.cos(torch.arange(y.numel(), dtype=y.dtype)).view_as(y))
        outs.append(y.detach())
        grads.append([xi.grad] + [p.grad for p in m.parameters()])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-10, atol=1e-10)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
