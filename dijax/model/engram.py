"""Engram: n-gram hashed conditional memory added to the streams before some blocks (v41_spec §10).

Host side (numpy, once per model): the compressed token map from a ``tokenizers`` tokenizer, the primes, the
offsets and the per-layer multipliers. Device side (jnp): the rolling hash with exact int64 semantics, emulated with
16-bit limbs in uint32 (no x64 needed), and the gated Engram layer.

Letters: T tokens, G n-gram window (max_ngram), E Engram layers, J hash columns ((max_ngram - 1) * heads),
C hc copies, D model dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dijax.config import ModelConfig
from dijax.kernels import quant
from dijax.kernels.quant import FP8_BLOCK
from dijax.model.layers import QuantLinear, linear, param, values
from dijax.kernels.numerics import mean
from dijax.parallel.engram import table_rows

DEAD = -1  # compressed id of a token that takes no part in any n-gram (image spans)


def build_compressed_token_map(tokenizer) -> tuple[np.ndarray, int]:
    """Token id -> compressed id: tokens whose decoded text normalises alike share one id (first-seen order).

    Normalisation: NFKC, NFD, strip accents, lowercase, collapse ``[ \\t\\r\\n]+`` to one space, keep a lone space,
    strip. Tokens whose decoding contains U+FFFD are keyed by their raw token string.
    tokenizer: a ``tokenizers.Tokenizer``. Returns (lookup int32 [vocab], number of compressed ids).
    """
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"  # private-use: a token that is exactly one space must survive Strip()
    normalizer = normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(),
        normalizers.Replace(sentinel, " "),
    ])
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    key_to_id: dict[str, int] = {}
    lookup = np.zeros(size, np.int32)
    for token_id in range(size):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        lookup[token_id] = key_to_id.setdefault(key, len(key_to_id))
    return lookup, len(key_to_id)


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def engram_primes(cfg: ModelConfig) -> np.ndarray:
    """Bucket moduli int64 [E, max_ngram - 1, heads]: successive unused primes above ``engram_vocab_size - 1``,
    handed out in (layer, n-gram size, head) order; each n-gram size restarts its search at the vocab size."""
    seen: set[int] = set()
    primes = np.zeros((len(cfg.engram_layer_ids), cfg.engram_max_ngram_size - 1, cfg.engram_n_heads), np.int64)
    for e in range(primes.shape[0]):
        for n in range(primes.shape[1]):
            current = cfg.engram_vocab_size - 1
            for h in range(primes.shape[2]):
                current += 1
                while not _is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                primes[e, n, h] = current
    return primes


def hash_multipliers(layer_ids: tuple[int, ...], max_ngram: int, compressed_vocab: int) -> np.ndarray:
    """int64 [E, max_ngram]: ``2 * rng.integers(0, bound, max_ngram) + 1`` with ``rng = default_rng(10007 * L)``."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    rows = [np.random.default_rng(10007 * layer).integers(0, bound, size=(max_ngram,), dtype=np.int64) * 2 + 1
            for layer in layer_ids]
    return np.stack(rows)


@dataclass(frozen=True)
class EngramTables:
    """Host constants of the hash. token_map [V] int32, pad_id, primes [E, J] int64, offsets [E, J] int64,
    multipliers [E, G] int64 (n-gram window G = max_ngram)."""

    token_map: np.ndarray
    pad_id: int
    primes: np.ndarray
    offsets: np.ndarray
    multipliers: np.ndarray

    @classmethod
    def build(cls, cfg: ModelConfig, tokenizer) -> "EngramTables":
        return cls.from_token_map(cfg, *build_compressed_token_map(tokenizer))

    @classmethod
    def from_token_map(cls, cfg: ModelConfig, token_map: np.ndarray, size: int) -> "EngramTables":
        """Tables for a given token -> compressed-id map [V] with ``size`` compressed ids (validated)."""
        if size != cfg.engram_compressed_vocab_size:
            raise ValueError(f"config field 'engram_compressed_vocab_size' is {cfg.engram_compressed_vocab_size} "
                             f"but the tokenizer normalises to {size} compressed ids")
        primes = engram_primes(cfg).reshape(len(cfg.engram_layer_ids), -1)
        for e, rows in enumerate(cfg.engram_num_embeddings):
            if int(primes[e].sum()) != rows:
                raise ValueError(f"config field 'engram_num_embeddings'[{e}] is {rows} but the layer's primes sum "
                                 f"to {int(primes[e].sum())}")
        offsets = np.concatenate([np.zeros_like(primes[:, :1]), np.cumsum(primes, axis=1)[:, :-1]], axis=1)
        return cls(token_map=token_map, pad_id=int(token_map[cfg.engram_pad_id]), primes=primes, offsets=offsets,
                   multipliers=hash_multipliers(cfg.engram_layer_ids, cfg.engram_max_ngram_size, size))

    def device_arrays(self) -> dict[str, jax.Array]:
        """What the jitted step needs: token map, and the constants split into uint32 limbs."""
        limbs = np.stack([(self.multipliers >> (16 * i)) & 0xFFFF for i in range(4)], axis=-1)
        return {
            "token_map": jnp.asarray(self.token_map, jnp.int32),
            "mult_limbs": jnp.asarray(limbs.astype(np.uint32)),  # [E, G, 4]
            "primes": jnp.asarray(self.primes.astype(np.uint32)),  # [E, J]
            "offsets": jnp.asarray(self.offsets.astype(np.int32)),  # [E, J]
        }

    def step_consts(self) -> dict[str, jax.Array]:
        """The ``consts`` argument of ``forward_step``: ``device_arrays()`` plus the compressed pad id."""
        return dict(self.device_arrays(), pad_id=jnp.int32(self.pad_id))


def ngram_window(ids_TG: jax.Array, positions_T: jax.Array, pad_id: int | jax.Array) -> jax.Array:
    """Apply the look-back rules to raw history. ids_TG[:, s] = compressed id at position p - s (anything where
    p - s < 0). Once p < s or a DEAD id is seen at this or a smaller shift, that shift and all later ones become
    ``pad_id``. Returns int32 [T, G]."""
    shifts = jnp.arange(ids_TG.shape[1])
    blocked = (positions_T[:, None] < shifts[None, :]) | (ids_TG == DEAD)
    blocked = jnp.cumsum(blocked.astype(jnp.int32), axis=1) > 0
    return jnp.where(blocked, pad_id, ids_TG).astype(jnp.int32)


def _mul_limbs(tok_T: jax.Array, mult_4: jax.Array) -> tuple[jax.Array, ...]:
    """(tok * mult) mod 2^64 as four 16-bit limbs, lowest first. tok_T: uint32 [...]; mult_4: uint32 [4]. -> four
    uint32 [...] arrays. (Kept apart, not stacked: the hash is elementwise work on [T] vectors that XLA fuses;
    a stacked [T, 4] array sliced back per limb left flash-slice's decode step ~11 slice kernels an Engram layer,
    deviceless, thirty-eighth session.)"""
    t = (tok_T & 0xFFFF, tok_T >> 16)
    cols = [jnp.zeros_like(tok_T) for _ in range(5)]
    for i in range(2):
        for j in range(4):
            if i + j > 3:
                continue
            pp = t[i] * mult_4[j]  # < 2^32: two 16-bit factors
            cols[i + j] = cols[i + j] + (pp & 0xFFFF)
            cols[i + j + 1] = cols[i + j + 1] + (pp >> 16)
    limbs, carry = [], jnp.zeros_like(tok_T)
    for c in range(4):
        v = cols[c] + carry
        limbs.append(v & 0xFFFF)
        carry = v >> 16
    return tuple(limbs)


def _mod_limbs(limbs: tuple[jax.Array, ...], prime: jax.Array) -> jax.Array:
    """Unsigned 64-bit value in four 16-bit limbs (lowest first) mod ``prime`` (< 2^24), by Horner over bytes.
    -> uint32."""
    r = jnp.zeros(limbs[0].shape, jnp.uint32)
    for c in (3, 2, 1, 0):
        for shift in (8, 0):
            byte = (limbs[c] >> shift) & 0xFF
            r = ((r << 8) + byte) % prime
    return r


def hash_rows(window_TG: jax.Array, dev: dict[str, jax.Array], engram_index: int) -> jax.Array:
    """Table rows of the J hash columns of every token for one Engram layer. window_TG: int32 [T, G] ->
    int32 [T, J]: for n-gram size n (2..G) and head h, ``(XOR_{s<n} tok_s * mult_s) mod prime + offset``."""
    mult = dev["mult_limbs"][engram_index]  # [G, 4]
    primes = dev["primes"][engram_index]  # [J]
    g = window_TG.shape[1]
    heads = primes.shape[0] // (g - 1)
    tok = window_TG.astype(jnp.uint32)
    rolling = _mul_limbs(tok[:, 0], mult[0])
    cols = []
    for s in range(1, g):
        rolling = tuple(a ^ b for a, b in zip(rolling, _mul_limbs(tok[:, s], mult[s])))
        for h in range(heads):
            cols.append(_mod_limbs(rolling, primes[(s - 1) * heads + h]))
    return jnp.stack(cols, axis=-1).astype(jnp.int32) + dev["offsets"][engram_index]


def engram(p: dict, x_TCD: jax.Array, rows_TJ: jax.Array, mask_T: jax.Array, norm_eps: float,
           linear_impl: str = "reference") -> jax.Array:
    """Gate one shared looked-up value into every stream. x_TCD: bf16 [T, C, D]; rows_TJ: int32 table rows;
    mask_T: bool (False = no contribution); linear_impl: the fp8 ``wkv``'s kernel. Returns bf16 [T, C, D]."""
    t, c, d = x_TCD.shape
    emb = quant.dequant_rows_fp8(*table_rows(p["embed"], rows_TJ))  # [T, J, W]; split by rows under ep
    kv = linear(emb.reshape(t, -1), p["wkv"], linear_impl)  # [T, (C + 1) * D]
    key_TCD = kv[:, :c * d].astype(jnp.float32).reshape(t, c, d)
    value_TD = kv[:, c * d:]
    weight_CD = p["q_weight"].astype(jnp.float32) * p["k_weight"].astype(jnp.float32)
    h = x_TCD.astype(jnp.float32)
    eps = np.float32(norm_eps)
    rstd = (jax.lax.rsqrt(mean(jnp.square(h), keepdims=False) + eps)
            * jax.lax.rsqrt(mean(jnp.square(key_TCD), keepdims=False) + eps))
    dot = jnp.sum(h * weight_CD * key_TCD, axis=-1) * rstd * np.float32(d ** -0.5)
    gate = jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), np.float32(1e-6))), dot))
    gate = jnp.where(mask_T[:, None], gate, 0.0)
    return (h + gate[..., None] * value_TD.astype(jnp.float32)[:, None, :]).astype(x_TCD.dtype)


class EngramTable(nnx.Module):
    """An Engram table in fp8 rows: ``weight`` [rows, W] e4m3 and ``scale`` [rows, W / 32] ue8m0 bytes."""

    def __init__(self, rows: int, width: int, stack: tuple[int, ...] = ()):
        self.weight = param(stack, (rows, width), jnp.float8_e4m3fn, ("engram_rows", "engram_dim"))
        self.scale = param(stack, (rows, width // FP8_BLOCK), jnp.uint8, ("engram_rows", "engram_dim"))


class Engram(nnx.Module):
    """The Engram lookup before one block (checkpoint ``engram``): ``embed`` table, fp8 ``wkv``
    [(C + 1) * D, J * W], bf16 ``q_weight`` and ``k_weight`` [C, D].

    rows: the table's rows (``engram_num_embeddings`` of this Engram layer; split over the ``ep`` mesh axis under
    expert parallelism, dijax.parallel.engram).
    """

    def __init__(self, cfg: ModelConfig, rows: int, stack: tuple[int, ...] = ()):
        self.norm_eps = cfg.norm_eps
        c, d, w = cfg.hc_mult, cfg.dim, cfg.engram_head_dim
        self.embed = EngramTable(rows, w, stack)
        self.wkv = QuantLinear(cfg.engram_n_cols * w, (c + 1) * d, "fp8", ("engram_out", "engram_in"), stack)
        self.q_weight = param(stack, (c, d), jnp.bfloat16, ("stream", "embed"))
        self.k_weight = param(stack, (c, d), jnp.bfloat16, ("stream", "embed"))

    def __call__(self, x_TCD: jax.Array, rows_TJ: jax.Array, mask_T: jax.Array,
                 linear_impl: str = "reference") -> jax.Array:
        """See ``engram``: x_TCD bf16 [T, C, D], rows_TJ int32, mask_T bool -> bf16 [T, C, D]."""
        return engram(values(self), x_TCD, rows_TJ, mask_T, self.norm_eps, linear_impl)
