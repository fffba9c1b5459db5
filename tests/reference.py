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


class CountingExplicitBackend(ExplicitBackend):
    """:class:`ExplicitBackend` that counts the attention calls it serves."""

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, *args, **kw):
        self.calls += 1
        return super().encode(*args, **kw)

    def decode(self, *args, **kw):
        self.calls += 1
        return super().decode(*args, **kw)

    def self_attention(self, *args, **kw):
        self.calls += 1
        return super().self_attention(*args, **kw)


def assert_backend_parity(module, x, mask=None) -> int:
    """``module`` on the fused backend equals a copy on :class:`ExplicitBackend`: outputs
    and the gradients of the input and every parameter (float64, 1e-10). Returns how many
    attention calls the explicit copy served (0: the comparison checked nothing)."""
    import copy

    from flarepp.ops import set_backend
    explicit = copy.deepcopy(module)
    backend = CountingExplicitBackend()
    set_backend(explicit, backend)
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
    return backend.calls


# ----------------------------------------------------------------------------------------
# Causal mixers (flarepp.mixers.causal), with the N x N causal routing built explicitly.
# ----------------------------------------------------------------------------------------

def causal_allowed(N, mask=None, *, batch=1):
    """``allowed[b, t, s]``: token t may read token s (s <= t and s real), ``[B, N, N]``."""
    allowed = torch.ones(N, N, dtype=torch.bool).tril().expand(batch, N, N)
    return allowed if mask is None else allowed & mask[:, None, :]


def explicit_causal_encode_weights(scores, mask=None):
    """``E[b, h, t, s, m] = exp(a[s, m] - L_t[m])`` for allowed (t, s), else 0, where
    ``L_t[m] = log sum_{s allowed} exp a[s, m]``: latent m's softmax over the prefix of t."""
    B, H, N, M = scores.shape
    allowed = causal_allowed(N, mask, batch=B)[:, None, :, :, None]        # [B,1,t,s,1]
    logits = scores[:, :, None, :, :].expand(B, H, N, N, M).masked_fill(~allowed, float("-inf"))
    return masked_softmax(logits.transpose(-1, -2), None).transpose(-1, -2)


def explicit_causal_routing(scores, mask=None):
    """The N x N causal FLARE routing ``R[t, s] = sum_m softmax_M(a[t])_m E[t, s, m]``."""
    return torch.einsum("bhtm,bhtsm->bhts", torch.softmax(scores, dim=-1),
                        explicit_causal_encode_weights(scores, mask))


def reference_causal_mixer(name: str, mixer, x, mask=None):
    """A causal mixer's output from its parameters, explicit N x N forms throughout."""
    c = mixer.config
    H = c.heads
    s = _scale(c.head_dim, c.attn_scale)
    if mask is not None:
        x = x * mask[..., None]
    out_w, out_b = mixer.out_proj.weight, mixer.out_proj.bias
    if name == "attention-causal":
        (wq, _), (wk, _), (wv, _) = _split_weights(mixer.qkv_proj, 3)
        q, k, v = (_heads(_lin(x, w, None), H) for w in (wq, wk, wv))
        allowed = causal_allowed(x.shape[1], mask, batch=x.shape[0])[:, None]
        y = masked_softmax(s * q @ k.transpose(-1, -2), allowed) @ v
    else:
        if name == "flare-causal":
            (wk, bk), (wv, bv) = _split_weights(mixer.key_value_proj, 2)
            K, V = _heads(_lin(x, wk, bk), H), _heads(_lin(x, wv, bv), H)
            scores = s * torch.einsum("bhnd,hmd->bhnm", K, mixer.fixed_queries)
        elif name == "flarepp-causal":
            (wsk, bsk), (wk, bk), (wv, bv) = _split_weights(mixer.key_value_proj, 3)
            Kt = _norm(mixer.synthesis_key_norm, _heads(_lin(x, wsk, bsk), H))     # N_0
            K = _norm(mixer.routing_key_norm, _heads(_lin(x, wk, bk), H))          # N_a
            V = _heads(_lin(x, wv, bv), H)
            seeds = _norm(mixer.seed_norm, mixer.synthesis_seeds)                  # N_a
            synthesis = explicit_causal_encode_weights(
                s * torch.einsum("bhnd,hmd->bhnm", Kt, seeds), mask)               # [B,H,t,s,M]
            Qd = torch.einsum("bhtsm,bhsd->bhtmd", synthesis, Kt)      # per-token queries
            Qf = _norm(mixer.fixed_query_norm, mixer.fixed_queries)                # N_0
            Q = Qf[None, :, None] + torch.sigmoid(mixer.gate_logit).view(1, H, 1, 1, 1) * Qd
            scores = s * torch.einsum("bhtmd,bhtd->bhtm", Q, K)
        else:
            raise KeyError(name)
        y = explicit_causal_routing(scores, mask) @ V
    out = _lin(_unheads(y), out_w, out_b)
    return out if mask is None else out * mask[..., None]


# ----------------------------------------------------------------------------------------
# Higher-order attention (flarepp.mixers.higher_order), as sums over tuples of tokens.
# ----------------------------------------------------------------------------------------

_TOKEN_LETTERS = "jklopr"


def explicit_multilinear(q, keys, values, mask=None):
    """The linearised L-simplicial attention summed over L-tuples of real tokens:
    ``A[i, j1..jL] = sum_d' Q_id' prod_l K_l[j_l, d']``,
    ``Y_id = N^-L sum_{j1..jL} A[i, j1..jL] prod_l V_l[j_l, d]``; ``O(N^(L+1))``."""
    L = len(keys)
    if mask is not None:
        keys = [k * mask[:, None, :, None] for k in keys]
    idx = _TOKEN_LETTERS[:L]
    scores = torch.einsum(",".join(["bhie"] + [f"bh{j}e" for j in idx]) + f"->bhi{idx}",
                          q, *keys)
    y = torch.einsum(",".join([f"bhi{idx}"] + [f"bh{j}d" for j in idx]) + "->bhid",
                     scores, *values)
    n = q.shape[2] if mask is None else mask.sum(1).clamp_min(1).view(-1, 1, 1, 1)
    y = y / n ** L
    return y if mask is None else y * mask[:, None, :, None]


def explicit_triple(q1, q2, k1, k2, v, mask=None):
    """``Y_n = (1/N) sum_{m real} (q1_n . k1_m)(q2_n . k2_m) v_m``: the N x N token-pair form."""
    pair = (q1 @ k1.transpose(-1, -2)) * (q2 @ k2.transpose(-1, -2))     # [B, H, N, N]
    if mask is not None:
        pair = pair * mask[:, None, None, :]
    n = q1.shape[2] if mask is None else mask.sum(1).clamp_min(1).view(-1, 1, 1, 1)
    y = pair @ v / n
    return y if mask is None else y * mask[:, None, :, None]


def reference_higher_order_mixer(name: str, mixer, x, mask=None):
    """A higher-order mixer's output from its parameters, explicit tuple sums."""
    H = mixer.config.heads
    if mask is not None:
        x = x * mask[..., None]
    if name == "multilinear":
        L = mixer.config.order
        parts = [_heads(_lin(x, w, None), H) for w, _ in _split_weights(mixer.qkv_proj, 1 + 2 * L)]
        y = explicit_multilinear(parts[0], parts[1::2], parts[2::2], mask)
    elif name == "triple":
        parts = [_heads(_lin(x, w, None), H) for w, _ in _split_weights(mixer.qkv_proj, 5)]
        y = explicit_triple(*parts, mask)
    else:
        raise KeyError(name)
    out = _lin(_unheads(y), mixer.out_proj.weight, mixer.out_proj.bias)
    return out if mask is None else out * mask[..., None]
