"""The capture format: safetensors shards of packed samples + manifest.json.

One shard holds the samples [k*S, (k+1)*S) of the prepared data, packed end to end:

    input_ids          int32  [N]         N = tokens in the shard
    loss_mask          uint8  [N]
    cu_seqlens         int64  [n + 1]     sample s is tokens cu_seqlens[s]:cu_seqlens[s+1]
    sample_index       int64  [n]         row in the prepared dataset
    aux_layer_ids      int64  [L]         the stored layer ids (the manifest's, checked on read)
    aux_hidden_states  dtype  [N, L*H]    the manifest's aux_layer_ids (strictly increasing, entering-layer
                                          convention), concatenated in that order
    last_hidden_state  dtype  [N, H]      last decoder layer's output before the final norm
    target_argmax      int32  [N]         the target's greedy next token (from the full-precision state)
    aux_scales         fp32   [N, L]      store dtype float8_e4m3 only: per token and layer, x = q * scale
    last_scales        fp32   [N, 1]      store dtype float8_e4m3 only

store dtype (the manifest's store_dtype): float32, bfloat16, float16, or float8_e4m3 with a
scale per row (token) and layer: scale = max|x| / 448 (e4m3's largest finite value), q =
x / scale rounded to e4m3, so every row uses e4m3's whole range and none clips (the per-token
scaling FP8 activations use in vLLM's ptpc_fp8); training dequantizes on its device
(trainer/data/collate.py `dequantize_states`).

A shard is complete when `<shard>.json` (its sha256 and counts) exists beside it;
both are written atomically, the sidecar last, so a killed capture never leaves a
shard that looks complete. The capture is complete when manifest.json exists
(`write_manifest`, last of all): the target, the stored layer ids and each draft's subset
in their one convention, the store dtype, the engine, the data it came from, counts,
bytes per token, the draft vocabulary (draft_vocab.safetensors: d2t, t2d, counts) and
every shard's sha256.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from trainer.data.vocab import build_draft_vocab, coverage
from trainer.errors import DataError, DraftsmithError
from trainer.io import atomic_save_safetensors, atomic_write_json, sha256_file
from trainer.layer_ids import LAYER_ID_CONVENTION, check_layer_ids

FORMAT = "draftsmith-capture-v3"  # v2: draft_layer_ids, one layer-id convention; v3: target_argmax
MANIFEST = "manifest.json"
DRAFT_VOCAB = "draft_vocab.safetensors"
STORE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float8_e4m3": torch.float8_e4m3fn}
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
SCALES = {"aux_hidden_states": "aux_scales", "last_hidden_state": "last_scales"}  # float8 only


def _first_bad(aux: torch.Tensor, last: torch.Tensor, lengths: list[int] | None) -> tuple[int, int, int] | None:
    """(row, token, state) of the first inf/NaN in aux [B, T, L*H] / last [B, T, H] (or [T, ...]
    for one sample), padding past `lengths` ignored: state k < L is the k-th stored aux layer,
    state L the last layer's. None when every value is finite."""
    H = last.shape[-1]
    states = torch.cat([aux.unflatten(-1, (-1, H)), last[..., None, :]], dim=-2)  # [B, T, L+1, H] or [T, L+1, H]
    bad = ~torch.isfinite(states).all(-1)  # [B, T, L+1] or [T, L+1]
    if bad.dim() == 2:
        bad = bad[None]  # [1, T, L+1]
    if lengths is not None:
        real = torch.arange(bad.shape[1], device=bad.device)[None] < torch.tensor(lengths, device=bad.device)[:, None]
        bad &= real[..., None]
    if not bool(bad.any()):
        return None
    r, t, k = (int(x) for x in bad.nonzero()[0])
    return r, t, k


def _who(samples: list | None, r: int, one: bool) -> str:
    return f"sample {samples[r]}" if samples is not None else "a sample" if one else f"row {r} of the batch"


def check_finite(aux: torch.Tensor, last: torch.Tensor, samples: list | None = None,
                 lengths: list[int] | None = None) -> None:
    """Refuse states holding inf/NaN, naming the first such sample: aux [B, T, L*H] and last
    [B, T, H] (a batch; `samples` names each row, `lengths` its real tokens, the rest padding),
    or [T, L*H] and [T, H] (one sample, `samples` its one name). Stored, they would train a draft
    on NaN (and float8's per-row scale turns one inf into a row of NaN)."""
    found = _first_bad(aux, last, lengths)
    if found is None:
        return
    r, t, _ = found
    raise DataError(f"{_who(samples, r, last.dim() == 2)}: the target's hidden states hold inf/NaN (first at "
                    f"token {t}); a draft would train on NaN, so nothing is stored: check the target's weights and "
                    "target_dtype (float32 does not overflow where float16 may), or drop that conversation")


def store_states(aux: torch.Tensor, last: torch.Tensor, store_dtype: str, samples: list | None = None,
                 lengths: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Hidden states as a shard stores them: aux [..., L*H] and last [..., H] cast to the store
    dtype, or for float8_e4m3 quantized per row and layer with their scales (module docstring).
    States holding inf/NaN are refused first (`check_finite`: `samples` and `lengths` name them),
    and so are finite states the store dtype cannot hold (float16 above 65504 stores inf): what
    is checked is what is stored."""
    check_finite(aux, last, samples, lengths)
    dtype = STORE_DTYPES[store_dtype]
    if dtype != torch.float8_e4m3fn:
        out = {"aux_hidden_states": aux.to(dtype), "last_hidden_state": last.to(dtype)}
    else:
        out = {}
        for name, x in (("aux_hidden_states", aux), ("last_hidden_state", last)):
            H = last.shape[-1]
            rows = x.float().unflatten(-1, (-1, H))  # [..., L, H]
            scale = (rows.abs().amax(-1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)  # [..., L]
            out[name] = (rows / scale[..., None]).to(torch.float8_e4m3fn).flatten(-2)  # [..., L*H]
            out[SCALES[name]] = scale
    stored = [out["aux_hidden_states"], out["last_hidden_state"]]
    if dtype == torch.float8_e4m3fn:
        stored = [dequantize(out["aux_hidden_states"], out["aux_scales"], torch.float32),
                  dequantize(out["last_hidden_state"], out["last_scales"], torch.float32)]
    found = _first_bad(*stored, lengths)
    if found is not None:
        r, t, k = found
        L = aux.shape[-1] // last.shape[-1]
        state = "the last layer's state" if k == L else f"stored aux layer {k} of {L}"
        at = (r, t) if last.dim() == 3 else (t,)
        peak = float(torch.cat([aux[at], last[at]]).float().abs().max())
        raise DataError(f"{_who(samples, r, last.dim() == 2)}: {state} at token {t} does not fit store_dtype="
                        f"{store_dtype} (|x| up to {peak:.4g}, the dtype's largest is {torch.finfo(dtype).max:.4g}); "
                        "nothing is stored: use store_dtype=bfloat16 (float32's range) or float8_e4m3 (scaled)")
    return out


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """q [..., L*H] float8 with scale [..., L] -> [..., L*H] in `dtype`."""
    L = scale.shape[-1]
    return (q.float().unflatten(-1, (L, -1)) * scale.float()[..., None]).flatten(-2).to(dtype)


def bytes_per_token(num_layers: int, hidden_size: int, store_dtype: str) -> float:
    """What a token costs on disk: L aux states and the last state (H each) in the store dtype
    (+ a float32 scale per state for float8), its int32 id, uint8 mask and int32 greedy token."""
    states = (num_layers + 1) * hidden_size * torch.finfo(STORE_DTYPES[store_dtype]).bits / 8
    scales = (num_layers + 1) * 4 if store_dtype == "float8_e4m3" else 0
    return states + scales + 4 + 1 + 4


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def pack_samples(samples: list[dict[str, torch.Tensor]], sample_index: list[int]) -> dict[str, torch.Tensor]:
    """Concatenate per-sample tensors ([T_s, ...] each) into one shard's tensors."""
    lengths = torch.tensor([s["input_ids"].shape[0] for s in samples], dtype=torch.int64)
    cu = torch.zeros(len(samples) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu[1:])
    return {
        "input_ids": torch.cat([s["input_ids"] for s in samples]).to(torch.int32),  # [N]
        "loss_mask": torch.cat([s["loss_mask"] for s in samples]).to(torch.uint8),  # [N]
        "cu_seqlens": cu,  # [n+1]
        "sample_index": torch.tensor(sample_index, dtype=torch.int64),  # [n]
        "aux_hidden_states": torch.cat([s["aux_hidden_states"] for s in samples]).contiguous(),  # [N, L*H]
        "last_hidden_state": torch.cat([s["last_hidden_state"] for s in samples]).contiguous(),  # [N, H]
        "target_argmax": torch.cat([s["target_argmax"] for s in samples]).to(torch.int32),  # [N]
        **{k: torch.cat([s[k] for s in samples]).contiguous() for k in SCALES.values() if k in samples[0]},
    }


def write_shard(out_dir: Path, k: int, tensors: dict[str, torch.Tensor], aux_layer_ids: list[int]) -> dict:
    """The shard and its sidecar, both atomic, the sidecar last. The shard records the stored
    layer ids as a tensor (`aux_layer_ids`, checked against the manifest on read; a tensor,
    not metadata: safetensors writes a metadata map in no fixed order, and shards must be
    byte-identical however many processes wrote them)."""
    path = Path(out_dir) / shard_name(k)
    tensors = {**tensors, "aux_layer_ids": torch.tensor(aux_layer_ids, dtype=torch.int64)}
    atomic_save_safetensors(path, tensors, metadata={"format": FORMAT})
    entry = {"file": path.name, "sha256": sha256_file(path), "bytes": path.stat().st_size,
             "samples": int(tensors["sample_index"].numel()), "tokens": int(tensors["input_ids"].numel()),
             "loss_tokens": int(tensors["loss_mask"].sum())}
    atomic_write_json(path.with_suffix(".json"), entry)
    return entry


def completed_shard(out_dir: Path, k: int) -> dict | None:
    """The sidecar of shard k if the shard is complete and intact, else None."""
    path = Path(out_dir) / shard_name(k)
    side = path.with_suffix(".json")
    if not (path.is_file() and side.is_file()):
        return None
    try:
        entry = json.loads(side.read_text())
    except ValueError:  # a sidecar cut short: the shard is redone
        return None
    return entry if entry.get("bytes") == path.stat().st_size and sha256_file(path) == entry.get("sha256") else None


def write_manifest(out: Path, *, target, target_dtype: str, layer_ids: list[int], draft_layer_ids: dict,
                   store_dtype: str, engine: dict, data: dict, samples: int, entries: list[dict], counts: torch.Tensor,
                   draft_vocab_size: int, too_long: dict | None = None) -> dict:
    """The capture's draft vocabulary (the `draft_vocab_size` most frequent loss-masked tokens of
    `counts`) and then its manifest, the mark of a complete capture. `entries`: every shard's
    sidecar, in order; `engine`: {engine, version, engines}; `data`: where the samples came
    from (path, source, regenerated, the chat template and its sha256); `too_long`: the length
    limit and what it skipped (recipes/capture.py `fit_lengths`)."""
    d2t, t2d = build_draft_vocab(counts, min(draft_vocab_size, target.vocab_size))
    atomic_save_safetensors(Path(out) / DRAFT_VOCAB, {"d2t": d2t, "t2d": t2d, "counts": counts})
    tokens = sum(e["tokens"] for e in entries)
    manifest = {
        "format": FORMAT,
        "target": {"name": target.name, "path": target.path, "sha256": target.content_hash,
                   "num_layers": target.num_layers, "hidden_size": target.hidden_size,
                   "vocab_size": target.vocab_size, "dtype": target_dtype},
        "layer_id_convention": LAYER_ID_CONVENTION,
        "aux_layer_ids": layer_ids,  # the stored columns, in this order
        "draft_layer_ids": draft_layer_ids,  # the subset each draft algorithm trains on by default
        "store_dtype": store_dtype,
        "engine": engine,
        "data": data,
        "samples": samples, "tokens": tokens, "loss_tokens": sum(e["loss_tokens"] for e in entries),
        "bytes_per_token": {
            "on_disk": sum(e["bytes"] for e in entries) / tokens,
            # hidden states (L*H + H) in the store dtype (+ float8 scales), int32 id, uint8 mask, int32 argmax
            "expected": bytes_per_token(len(layer_ids), target.hidden_size, store_dtype),
        },
        "draft_vocab": {"file": DRAFT_VOCAB, "size": int(d2t.numel()), "coverage": coverage(counts, t2d)},
        "shards": entries,
        # the length limit and the prepared samples longer than it, skipped (never cut)
        **({"too_long": too_long} if too_long is not None else {}),
    }
    atomic_write_json(Path(out) / MANIFEST, manifest)  # last: its presence marks the capture complete
    return manifest


@dataclass
class CaptureInfo:
    path: Path
    manifest: dict

    @property
    def aux_layer_ids(self) -> list[int]:
        return self.manifest["aux_layer_ids"]


# What every manifest must hold (a hand-edited or cut-short one is refused by name).
MANIFEST_KEYS = ("format", "target", "layer_id_convention", "aux_layer_ids", "draft_layer_ids", "store_dtype",
                 "samples", "tokens", "draft_vocab", "shards")
TARGET_KEYS = ("name", "sha256", "num_layers", "hidden_size", "vocab_size")
SHARD_KEYS = ("file", "sha256", "bytes", "samples", "tokens")


def load_manifest(path: str | Path) -> CaptureInfo:
    """The capture's manifest, parsed and complete (every key, the layer-id convention, ids
    strictly increasing); one line naming the file and key otherwise. Shards are checked by
    `verify_capture`."""
    path = Path(path)
    f = path / MANIFEST
    if not path.is_dir():
        raise DataError(f"capture '{path}' is not a folder; pass the output_dir of `draftsmith capture`")
    if not f.is_file():
        raise DataError(f"'{path}' is not a finished capture (no {MANIFEST}); run or resume `draftsmith capture`")
    try:
        manifest = json.loads(f.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise DataError(f"{f} is not valid JSON ({err}); capture again or restore the file") from None
    if not isinstance(manifest, dict):
        raise DataError(f"{f} must hold a JSON object; capture again or restore the file")
    missing = [k for k in MANIFEST_KEYS if k not in manifest]
    missing += [f"target.{k}" for k in TARGET_KEYS if k not in (manifest.get("target") or {})]
    shards = manifest.get("shards")
    if isinstance(shards, list):
        missing += [f"shards[{i}].{k}" for i, e in enumerate(shards) for k in SHARD_KEYS
                    if not isinstance(e, dict) or k not in e]
    if missing:
        raise DataError(f"{f} is incomplete: missing {', '.join(missing[:5])}; capture again or restore the file")
    if not isinstance(shards, list) or not shards:
        raise DataError(f"{f}: 'shards' lists no shard; capture again")
    if manifest.get("format") != FORMAT:
        raise DataError(f"{f}: format {manifest.get('format')!r}, expected {FORMAT!r}; capture again with this version")
    if manifest.get("layer_id_convention") != LAYER_ID_CONVENTION:
        raise DataError(f"{f}: layer_id_convention {manifest.get('layer_id_convention')!r} is not "
                        f"{LAYER_ID_CONVENTION!r}; capture again with this version")
    try:
        check_layer_ids(manifest.get("aux_layer_ids") or [], f"{f}: aux_layer_ids")
        stored = manifest["aux_layer_ids"]
        per_draft = manifest.get("draft_layer_ids")
        if not isinstance(per_draft, dict):
            raise DataError(f"{f}: draft_layer_ids must map each draft to its layer ids; capture again")
        for name, ids in per_draft.items():  # each draft's ids: strictly increasing, among the stored columns
            check_layer_ids(ids, f"{f}: draft_layer_ids.{name}")
            if not set(ids) <= set(stored):
                raise DataError(f"{f}: draft_layer_ids.{name} {ids} are not all among the stored aux_layer_ids "
                                f"{stored}; the manifest was edited: restore it or capture again")
    except DraftsmithError as err:
        raise DataError(str(err)) from None
    return CaptureInfo(path, manifest)


def layer_columns(stored: list[int], wanted: list[int], hidden_size: int) -> torch.Tensor | None:
    """Column indices of `wanted` layers inside aux_hidden_states [.., len(stored)*H] (None: all, in order)."""
    missing = [i for i in wanted if i not in stored]
    if missing:
        raise DataError(f"layer ids {missing} are not in the capture (it holds {stored}); capture them or "
                        "choose a subset of the captured ids")
    if list(wanted) == list(stored):
        return None
    return torch.cat([torch.arange(stored.index(i) * hidden_size, (stored.index(i) + 1) * hidden_size)
                      for i in wanted])


STATE_ROWS = 1024  # tokens of a shard's states read at a time when verify_capture reads them all


def _first_non_finite(f, name: str) -> tuple[int, int] | None:
    """(token, column) of the first inf/NaN in the state tensor `name` [N, W] of the open shard
    `f`, read STATE_ROWS tokens at a time (float8 codes read as numbers: e4m3's NaN codes);
    None when every value is finite."""
    rows = f.get_slice(name)
    for a in range(0, rows.get_shape()[0], STATE_ROWS):
        x = rows[a:a + STATE_ROWS]
        bad = ~torch.isfinite(x.float() if x.element_size() == 1 else x)
        if bool(bad.any()):
            t, c = (int(v) for v in bad.nonzero()[0])
            return a + t, c
    return None


def verify_capture(path: str | Path, states: bool = False) -> CaptureInfo:
    """Check a capture where it is consumed (train, inspect-capture): the manifest is complete,
    every shard is there with its size and sha256 (each file hashed once), readable, holds
    the tensors of the layers the manifest names (its own record of the stored ids agrees,
    and the state widths are len(ids) x H and H), its float8 scales (if any) are finite and
    positive, and draft_vocab.safetensors is there and fits the target's vocabulary. One
    clear line on the first problem. `states` (inspect-capture): every stored state is read
    too and must be finite (a float8 NaN code, an inf a float16 cast made); train does not
    read them here (that costs the whole capture) and stops on a non-finite loss instead."""
    info = load_manifest(path)
    manifest, where = info.manifest, f"capture '{info.path}'"
    H, ids = manifest["target"]["hidden_size"], manifest["aux_layer_ids"]
    samples = 0
    for entry in manifest["shards"]:
        p = info.path / entry["file"]
        if not p.is_file():
            raise DataError(f"{where}: shard {entry['file']} is missing; capture again (resume keeps intact shards)")
        if p.stat().st_size != entry["bytes"] or sha256_file(p) != entry["sha256"]:
            raise DataError(f"{where}: shard {entry['file']} does not match its size/sha256 in {MANIFEST} "
                            "(changed or truncated); capture again")
        try:
            with safe_open(p, "pt") as f:
                keys = set(f.keys())
                stored = f.get_tensor("aux_layer_ids").tolist() if "aux_layer_ids" in keys else ids
                widths = {k: f.get_slice(k).get_shape() for k in ("aux_hidden_states", "last_hidden_state")
                          if k in keys}
                scales = {k: f.get_tensor(k) for k in SCALES.values() if k in keys}  # float8: [N, L] and [N, 1]
        except Exception as err:  # safetensors raises its own error types on a damaged header
            raise DataError(f"{where}: shard {entry['file']} is not readable safetensors ({err}); capture again") \
                from None
        need = {"input_ids", "loss_mask", "cu_seqlens", "aux_hidden_states", "last_hidden_state", "target_argmax",
                *(SCALES.values() if manifest["store_dtype"] == "float8_e4m3" else ())}
        if need - keys:
            raise DataError(f"{where}: shard {entry['file']} lacks {sorted(need - keys)}; capture again")
        if stored != ids:
            raise DataError(f"{where}: {MANIFEST} says aux_layer_ids {ids} but shard {entry['file']} stores "
                            f"{stored}; the manifest was edited: restore it or capture again")
        if widths["aux_hidden_states"][-1] != len(ids) * H or widths["last_hidden_state"][-1] != H:
            raise DataError(f"{where}: shard {entry['file']} holds states {widths['aux_hidden_states'][-1]} wide, "
                            f"but {len(ids)} layer ids x H={H} = {len(ids) * H}; the manifest does not describe it")
        for name, scale in scales.items():  # a float8 state is q * scale: one inf or NaN scale, a row of NaN
            bad = ~(torch.isfinite(scale) & (scale > 0))
            if bool(bad.any()):
                raise DataError(f"{where}: shard {entry['file']} holds {int(bad.sum())} {name} that are not finite "
                                f"and positive (first at token {int(bad.nonzero()[0, 0])}): its states would train "
                                "a draft on NaN; capture again (overwrite=true)")
        for name in ("aux_hidden_states", "last_hidden_state") if states else ():
            with safe_open(p, "pt") as f:
                found = _first_non_finite(f, name)
            if found is not None:
                t, c = found
                layer = f"aux layer id {ids[c // H]}" if name == "aux_hidden_states" else "the last layer"
                raise DataError(f"{where}: shard {entry['file']} holds inf/NaN in {name} (first at token {t}, "
                                f"{layer}, stored {manifest['store_dtype']}): its states would train a draft on NaN; "
                                "capture again (overwrite=true)")
        samples += entry["samples"]
    if samples != manifest["samples"]:
        raise DataError(f"{where}: the shards hold {samples} samples, {MANIFEST} says {manifest['samples']}; "
                        "capture again")
    vocab = info.path / DRAFT_VOCAB
    if not vocab.is_file():
        raise DataError(f"{where}: {DRAFT_VOCAB} is missing (the draft vocabulary); capture again")
    try:
        with safe_open(vocab, "pt") as f:
            shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    except Exception as err:
        raise DataError(f"{where}: {DRAFT_VOCAB} is not readable ({err}); capture again") from None
    V = manifest["target"]["vocab_size"]
    Vd = manifest["draft_vocab"]["size"]
    if shapes.get("t2d") != [V] or shapes.get("counts") != [V] or shapes.get("d2t") != [Vd]:
        raise DataError(f"{where}: {DRAFT_VOCAB} does not fit the manifest (d2t [{manifest['draft_vocab']['size']}], "
                        f"t2d and counts [{V}]; found {shapes}); capture again")
    return info


class CaptureReader:
    """Random access to captured samples: `reader[i]` -> dict of per-sample tensors."""

    def __init__(self, path: str | Path, layer_ids: list[int] | None = None):
        """layer_ids: the subset of the captured aux layers to return (default: all, in order)."""
        self.info = load_manifest(path)
        manifest = self.info.manifest
        self._columns = layer_columns(manifest["aux_layer_ids"], layer_ids, manifest["target"]["hidden_size"]) \
            if layer_ids is not None else None
        self._layers = None if self._columns is None else [manifest["aux_layer_ids"].index(i) for i in layer_ids]
        self._names = ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state", "target_argmax",
                       *(SCALES.values() if manifest["store_dtype"] == "float8_e4m3" else ()))
        self._index: list[tuple[int, int]] = []  # global sample -> (shard, row)
        self._cu: list[torch.Tensor] = []
        for k, entry in enumerate(self.info.manifest["shards"]):
            with safe_open(self.info.path / entry["file"], "pt") as f:
                cu = f.get_tensor("cu_seqlens")
            self._cu.append(cu)
            self._index += [(k, r) for r in range(cu.numel() - 1)]

    def __len__(self) -> int:
        return len(self._index)

    def lengths(self) -> list[int]:
        """Every sample's tokens, in order (from the shards' cu_seqlens: no state read)."""
        return [int(self._cu[k][r + 1] - self._cu[k][r]) for k, r in self._index]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        k, r = self._index[i]
        a, b = int(self._cu[k][r]), int(self._cu[k][r + 1])
        out = {}
        with safe_open(self.info.path / self.info.manifest["shards"][k]["file"], "pt") as f:
            for name in self._names:
                out[name] = f.get_slice(name)[a:b]
        if self._columns is not None:
            out["aux_hidden_states"] = out["aux_hidden_states"][:, self._columns]  # [T, L'*H]
            if "aux_scales" in out:
                out["aux_scales"] = out["aux_scales"][:, self._layers]  # [T, L']
        return out
