"""Sweep every causal-LM model type of the installed transformers through tierkv.

A developer's tool, not a test (a full pass over about 200 types takes an hour or more on 2 cores).
Usage, from the repository root (SWEEP_RESULTS picks the results folder, default
benchmarks/out/arch_sweep/results, which git ignores; SWEEP_DTYPE=bfloat16 (or float16) builds every
model in that dtype, float32 by default: give it its own SWEEP_RESULTS so the dtypes' results stay apart):
    nice -n 10 python -m benchmarks.arch_sweep run [TYPE ...]     # all types not yet in RESULTS (or those named)
    python -m benchmarks.arch_sweep table                          # summary of RESULTS
    python -m benchmarks.arch_sweep one TYPE                       # one type in this process, verbose
    nice -n 10 python -m benchmarks.arch_sweep restart TYPE ...    # turns 0-1 in one process, turn 2 in a new one
    nice -n 10 python -m benchmarks.arch_sweep modes TYPE ...      # turn 1 in beams / beams x2 / sampling / prompt lookup

A TYPE may carry a variant: TYPE+full (windows longer than any conversation, every layer
full attention), TYPE+decoder (is_decoder=True, BERT-likes), TYPE+cache (use_cache=True, MPT),
TYPE+lang (X-MOD's default language).

Per type: a tiny random config (2 layers, hidden 64, 4 heads, vocab 256; fields set only where the
default config has them; windows cut to 16 tokens so they matter), a two-turn conversation through
a TieredStore whose budgets hold about one block on the device and one in the host tier (the rest
on disk), then a new store on the same path and a third turn. Each turn: greedy tokens and the
first step's logits (finite ones, relative to their std, 1e-3 in float32, LOGIT_TOL below for the others) against
plain ``generate`` (DynamicCache), and against a control with no tierkv in it: the DynamicCache
the previous turn's control generate returned, cropped to the tokens tierkv restored, then
``generate`` with it. That control is what tierkv stands in for: KV computed by earlier turns
(some rows by decode steps), and the new tokens computed against it, a shorter prefill than plain's
one over the whole conversation. In float32 the two agree to rounding; in bfloat16 other shapes of
the same kernels round differently (OLMo: its K/V equal plain's bit for bit, its first logits 1.2%
of their std apart), and a near tie of the tiny random models' logits then flips a greedy token,
with or without tierkv.
Classes: exact / refused (ValueError/TypeError raised by tierkv) / WRONG (tokens or logits differ
from plain and from the control) / drift (tokens or logits differ from plain, but tierkv's equal
the control's, tokens exactly and logits to CONTROL_TOL: transformers' own, not tierkv's) /
crash (any other exception in a tierkv turn) / skip (the model cannot be built or plain generate
fails at these sizes: not tierkv's; then open alone is tried and its answer noted).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

RESULTS = Path(os.environ.get("SWEEP_RESULTS", "benchmarks/out/arch_sweep/results"))
SCRATCH = RESULTS.parent / "scratch"  # the stores' directories, one per type and pass
BLOCK = 8
NEW = 5
TIMEOUT = int(os.environ.get("SWEEP_TIMEOUT", "150"))
DTYPE = os.environ.get("SWEEP_DTYPE", "float32")
# bfloat16 keeps 8 bits of mantissa: logits of a restored prefix vs a full prefill differ by a few
# of its ulps relative to their std; float16 by a few of its (11 bits).
LOGIT_TOL = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 1e-2}
# tierkv and the control run the same kernels on the same K/V (stored losslessly), so they agree
# to far below any dtype's rounding of a logit.
CONTROL_TOL = 1e-6

SIZES = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, n_embd=64, n_layer=2, n_head=4, n_inner=128, d_model=64,
    num_layers=2, n_layers=2, n_heads=4, ffn_dim=128, decoder_layers=2, encoder_layers=2,
    decoder_attention_heads=4, encoder_attention_heads=4, decoder_ffn_dim=128, encoder_ffn_dim=128,
    num_decoder_layers=2, d_ff=128, d_kv=16, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
    max_position_embeddings=512, n_positions=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    decoder_start_token_id=1, embedding_size=64, word_embed_proj_dim=64, rotary_dim=8,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    mamba_n_heads=4, mamba_d_head=16, mamba_head_dim=16, ssm_state_size=16, state_size=16, mamba_d_state=16,
    n_groups=1, mamba_n_groups=1, time_step_rank=8, conv_kernel=4, expand=2, first_k_dense_replace=1,
    num_key_value_groups=1, n_group=1, topk_group=1, attention_chunk_size=None,
    vocab_size_per_layer_input=256, unpadded_vocab_size=256, num_kv_shared_layers=0,
    H_cycles=1, L_cycles=1, L_bp_cycles=[1],
)
SLIDING = 16
VARIANT = ""  # "full": windows off, every layer full attention; "decoder": is_decoder=True; "cache": use_cache=True  # shorter than the conversation (about 45 tokens), so windows matter


def shrink_types(types: list[str]) -> list[str]:
    """Two layer types, keeping both kinds where the default mixes them."""
    kinds = list(dict.fromkeys(types))
    if len(kinds) == 1:
        return kinds * 2
    return kinds[:2]


def fill(config, defaults) -> None:
    for key, value in SIZES.items():
        try:
            present = hasattr(defaults, key)
        except Exception:
            present = False
        if present and key != "attention_chunk_size":
            try:
                setattr(config, key, value)
            except Exception:
                pass
    for key in ("sliding_window", "attention_chunk_size", "sliding_window_size", "window_size", "local_window_size"):
        if getattr(config, key, None):
            setattr(config, key, SLIDING)
    for key in ("layer_types", "layers_block_type", "hybrid_override_pattern", "block_types"):
        value = getattr(config, key, None)
        try:
            if isinstance(value, (list, tuple)) and value:
                setattr(config, key, shrink_types(list(value)))
            elif isinstance(value, str) and value and key == "hybrid_override_pattern":
                setattr(config, key, "".join(dict.fromkeys(value))[:2].ljust(2, value[0]))
        except Exception:
            pass
    if VARIANT == "full":
        # Windows longer than any conversation here (None trips some configs' validators).
        for key in ("sliding_window", "attention_chunk_size", "sliding_window_size"):
            if getattr(config, key, None):
                setattr(config, key, 4096)
        types = getattr(config, "layer_types", None)
        if isinstance(types, (list, tuple)):
            try:
                config.layer_types = ["full_attention"] * len(types)
            except Exception:
                pass
    if VARIANT in ("decoder", "lang"):
        config.is_decoder = True
    if VARIANT == "cache":
        config.use_cache = True


def build(model_type: str):
    import torch
    global VARIANT
    model_type, _, VARIANT = model_type.partition("+")
    from transformers import AutoConfig, AutoModelForCausalLM
    defaults = AutoConfig.for_model(model_type)
    fields = {k: v for k, v in SIZES.items() if k != "attention_chunk_size" and _has(defaults, k)}
    latent = {}
    if _has(defaults, "kv_lora_rank"):
        # Latent attention: every head its own KV, derived dims again; the cache's keys (the latent,
        # 32 wide) and values (the rotary keys, 8) of other widths, as in real checkpoints (512 and
        # 64), and the rotary embedding as wide as the rotary keys (head_dim).
        latent = dict(num_key_value_heads=4, qk_head_dim=32, kv_lora_rank=32, qk_rope_head_dim=8,
                      qk_nope_head_dim=24, v_head_dim=24, head_dim=8)
        fields.update({k: v for k, v in latent.items() if k in ("num_key_value_heads", "qk_head_dim") or _has(defaults, k)})
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except Exception:
        config = AutoConfig.for_model(model_type)
    fill(config, defaults)
    for key in latent:
        if key in fields and _has(config, key):
            try:
                setattr(config, key, fields[key])
            except Exception:
                pass
    for sub in ("text_config", "decoder"):
        inner = getattr(config, sub, None)
        if inner is not None and hasattr(inner, "to_dict"):
            fill(inner, inner)
    with torch.device("meta"):
        probe = AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for p in probe.parameters())
    if n > 30_000_000:
        raise RuntimeError(f"SKIP too big at these fields: {n} parameters")
    torch.manual_seed(0)
    # Built in the dtype, as from_pretrained(dtype=...) does, not cast after: buffers that a model
    # keeps in float32 on purpose (rotary frequencies) stay so, as in users' models.
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, DTYPE)).eval()
    if VARIANT == "lang":
        model.set_default_language(list(config.languages)[0])
    return model


def _has(obj, key) -> bool:
    try:
        return hasattr(obj, key)
    except Exception:
        return False


def ids_of(n: int, seed: int):
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (1, n), generator=g)


def greedy(model, ids, cache_out: list | None = None, **kw):
    """Greedy tokens and the first step's logits; the cache generate returned appended to cache_out."""
    import torch
    with torch.no_grad():
        r = model.generate(ids, max_new_tokens=NEW, do_sample=False, output_scores=True,
                           return_dict_in_generate=True, **kw)
    if cache_out is not None:
        cache_out.append(r.past_key_values)
    return r.sequences, r.scores[0][0]


def logit_rel(got, want) -> float:
    """Largest difference of the finite logits relative to their std; inf where the infinite ones differ."""
    import torch
    a, b = got.float(), want.float()
    finite = torch.isfinite(b)
    if a.shape != b.shape or not torch.equal(torch.isfinite(a), finite) or not torch.equal(a[~finite], b[~finite]):
        return float("inf")
    if not finite.any():
        return 0.0
    return float((a[finite] - b[finite]).abs().max()) / (float(b[finite].std()) or 1.0)


def control(model, ids, previous: list, restored: int):
    """Plain generate from the previous turn's control cache cropped to ``restored`` tokens: what
    tierkv restoring those tokens stands in for. None where that cache cannot be cropped."""
    if previous and previous[-1] is None:  # the chain broke at an earlier turn
        return None
    try:
        if not previous:
            return greedy(model, ids, cache_out=previous)
        cache = previous[-1]
        cache.crop(restored - cache.get_seq_length())  # transformers >= 5.24 takes the tokens to remove
        return greedy(model, ids, cache_out=previous, past_key_values=cache)
    except Exception:  # not tierkv's: the sweep then judges against plain alone
        previous.append(None)
        return None


def kv_bytes_per_token(model, ids) -> int:
    import torch
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return max(total // ids.shape[1], 1)


def tierkv_frame(exc: BaseException) -> bool:
    tb = traceback.extract_tb(exc.__traceback__)
    return bool(tb) and "/tierkv/" in tb[-1].filename


def one(model_type: str) -> dict:
    import torch
    from tierkv import TieredStore
    out: dict = {"type": model_type}
    t0 = time.time()
    try:
        model = build(model_type)
    except Exception as e:
        out.update(cls="skip", why=f"build: {type(e).__name__}: {str(e)[:300]}")
        return out
    out["model"] = type(model).__name__
    prompt = ids_of(21, 1)
    try:
        plain1, _ = greedy(model, prompt)
        plain2, _ = greedy(model, prompt)
        per_token = kv_bytes_per_token(model, prompt)
    except Exception as e:
        out.update(cls="skip", why=f"plain: {type(e).__name__}: {str(e)[:300]}")
        try:  # does open refuse it anyway?
            with TieredStore(None, device="cpu", block_size=BLOCK) as store:
                store.open(model, prompt)
            out["why"] += " || open accepts it"
        except Exception as e2:
            out["why"] += f" || open: {type(e2).__name__}: {str(e2)[:150]}"
        return out
    if not torch.equal(plain1, plain2):
        out["note"] = "plain generate not deterministic"
    block = per_token * BLOCK
    budgets = dict(device="cpu", device_budget=int(block * 1.5), host_budget=int(block * 1.5), block_size=BLOCK)
    turns = []
    controls: list = []  # the caches the control's generate returned, the last one next turn's
    path = Path(tempfile.mkdtemp(dir=SCRATCH)) / "kv"
    ids = prompt
    stage = "open"
    store = None
    try:
        store = TieredStore(path, **budgets)
        for turn in range(3):
            if turn == 2:
                stage = "restart"
                store.flush()
                store.close()
                store = TieredStore(path, **budgets)
            expected, scores = greedy(model, ids)
            stage = f"turn {turn} open"
            cache = store.open(model, ids, session="s")
            stage = f"turn {turn} generate"
            got, got_scores = greedy(model, ids, past_key_values=cache)
            restored = dict(cache.restored_from)
            stage = f"turn {turn} commit"
            kept = cache.commit(got)
            stage = f"turn {turn} control"
            ctl = control(model, ids, controls, cache.restored_tokens)
            rel = logit_rel(got_scores, scores)
            same = bool(torch.equal(got, expected))
            turn_out = dict(restored=restored, kept=kept, same=same, logit_rel=rel)
            like_control = None
            if ctl is not None:
                ctl_rel = logit_rel(got_scores, ctl[1])
                like_control = bool(torch.equal(got, ctl[0])) and ctl_rel <= CONTROL_TOL
                turn_out.update(control_same=bool(torch.equal(got, ctl[0])), control_rel=ctl_rel,
                                control_vs_plain=bool(torch.equal(ctl[0], expected)))
            turns.append(turn_out)
            if not same or rel > LOGIT_TOL[DTYPE]:
                what = (f"tokens: tierkv {got.tolist()[0][-NEW-3:]} plain {expected.tolist()[0][-NEW-3:]}" if not same
                        else f"logits off by {rel:.2e} (rel)")
                if like_control:
                    out.update(cls="drift", why=f"turn {turn} {what}, restored {restored}; the control (no tierkv) "
                                                f"gives tierkv's tokens, logits within {turn_out['control_rel']:.1e}")
                else:
                    out.update(cls="WRONG", why=f"turn {turn} {what}, restored {restored}; control: "
                                                + ("none (its cache cannot crop)" if ctl is None else
                                                   f"tokens {ctl[0].tolist()[0][-NEW-3:]}, "
                                                   f"logits off by {turn_out['control_rel']:.2e}"))
                    break
            elif like_control is False:
                out.update(cls="WRONG", why=f"turn {turn}: tokens equal plain's, but tierkv's logits differ from the "
                                            f"control's by {turn_out['control_rel']:.2e} (rel), restored {restored}")
                break
            ids = torch.cat([got, ids_of(6 - turn, 100 + turn)], dim=1)
        store.close()
    except (ValueError, TypeError) as e:
        if tierkv_frame(e):
            out.update(cls="refused", why=f"{stage}: {type(e).__name__}: {e}")
        else:
            out.update(cls="crash", why=f"{stage}: {type(e).__name__}: {str(e)[:400]}",
                       tb=traceback.format_exc()[-1500:])
    except Exception as e:
        out.update(cls="crash", why=f"{stage}: {type(e).__name__}: {str(e)[:400]}", tb=traceback.format_exc()[-1500:])
    finally:
        if store is not None:
            store.close()  # a refusal or crash left it open (closing again is a no-op)
    out["turns"] = turns
    out["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    if VARIANT == "decoder":
        out["note"] = "built with is_decoder=True"
    if "cls" not in out:
        out["cls"] = "exact"
        if not any(sum(t["restored"].values()) for t in turns[1:]):
            out["note"] = (out.get("note", "") + " restored nothing").strip()
    out["seconds"] = round(time.time() - t0, 1)
    return out


def restart_half(model_type: str, half: str, path: str) -> dict:
    """The restart in a new process: ``first`` runs turns 0 and 1 and closes the store; ``second``,
    in another process, builds the model again (same seed) and runs turn 2 from the disk."""
    import torch
    from tierkv import TieredStore
    model = build(model_type)
    state = Path(path) / "state.pt"
    if half == "first":
        per_token = kv_bytes_per_token(model, ids_of(21, 1))
        budgets = dict(device="cpu", device_budget=int(per_token * BLOCK * 1.5),
                       host_budget=int(per_token * BLOCK * 1.5), block_size=BLOCK)
        ids = ids_of(21, 1)
        with TieredStore(Path(path) / "kv", **budgets) as store:
            for turn in range(2):
                cache = store.open(model, ids, session="s")
                got, _ = greedy(model, ids, past_key_values=cache)
                cache.commit(got)
                ids = torch.cat([got, ids_of(6 - turn, 100 + turn)], dim=1)
        torch.save(dict(ids=ids, budgets=budgets), state)
        return {}
    saved = torch.load(state)
    ids = saved["ids"]
    expected, scores = greedy(model, ids)
    with TieredStore(Path(path) / "kv", **saved["budgets"]) as store:
        cache = store.open(model, ids, session="s")
        got, got_scores = greedy(model, ids, past_key_values=cache)
        restored = dict(cache.restored_from)
        cache.commit(got)
    a, b = got_scores.float(), scores.float()
    finite = torch.isfinite(b)
    rel = float((a[finite] - b[finite]).abs().max()) / (float(b[finite].std()) or 1.0)
    return dict(restored=restored, same=bool(torch.equal(got, expected)), logit_rel=rel, length=ids.shape[1])


def restart_sweep(types: list[str]) -> None:
    """Turns 0 and 1 for a batch of types in one process, turn 2 for them in another."""
    out_dir = RESULTS.parent / "restart"
    out_dir.mkdir(parents=True, exist_ok=True)
    SCRATCH.mkdir(parents=True, exist_ok=True)  # a fresh SWEEP_RESULTS: every batch crashed in mkdtemp
    todo = [t for t in types if not (out_dir / f"{t}.json").exists()]
    while todo:
        batch, todo = todo[:10], todo[10:]
        paths = {t: tempfile.mkdtemp(dir=SCRATCH) for t in batch}
        results: dict[str, dict] = {t: {"type": t} for t in batch}
        for half in ("first", "second"):
            args = [x for t in batch if "cls" not in results[t] for x in (t, paths[t])]
            p = subprocess.run([sys.executable, __file__, "halves", half, *args], capture_output=True, text=True,
                               timeout=900)
            for line in p.stdout.splitlines():
                if line.startswith("{"):
                    r = json.loads(line)
                    results[r["type"]].update(r)
            for t in batch:
                if f"{half}_done" not in results[t] and "cls" not in results[t]:
                    results[t].update(cls="crash", why=f"{half}: rc {p.returncode}: {p.stderr.strip().splitlines()[-1:]}")
        for t, r in results.items():
            if "cls" not in r:
                if not r["same"] or r["logit_rel"] > LOGIT_TOL[DTYPE]:
                    r["cls"] = "WRONG"
                elif r["restored"]["disk"] == 0:
                    r["cls"] = "MISS"  # restored nothing from disk after a restart
                else:
                    r["cls"] = "exact"
            (out_dir / f"{t}.json").write_text(json.dumps(r))
            print(f"{t:30} {r['cls']:6} {r.get('why', '')} {r.get('restored')} {r.get('logit_rel')}", flush=True)


def halves(half: str, args: list[str]) -> None:
    for t, path in zip(args[::2], args[1::2]):
        try:
            r = restart_half(t, half, path)
            r.update(type=t, **{f"{half}_done": True})
        except Exception as e:
            r = dict(type=t, cls="crash", why=f"{half}: {type(e).__name__}: {str(e)[:300]}")
        print(json.dumps(r), flush=True)


MODES = {
    "beams": dict(num_beams=3, do_sample=False),
    "beams2": dict(num_beams=3, num_return_sequences=2, do_sample=False),
    "sample": dict(do_sample=True, top_k=0),
    "lookup": dict(prompt_lookup_num_tokens=3, do_sample=False),
}


def modes_one(model_type: str) -> dict:
    """Turn 0 greedy; turn 1 (restored from device, host and disk) in each generation mode against
    plain generate in that mode (where they differ, against modes_control too: drift where it gives
    tierkv's tokens), then commit and a greedy turn 2 against plain (and where they differ, against
    turn2_control)."""
    import torch
    from tierkv import TieredStore
    model = build(model_type)
    out: dict = {"type": model_type, "modes": {}}
    per_token = kv_bytes_per_token(model, ids_of(21, 1))
    budgets = dict(device="cpu", device_budget=int(per_token * BLOCK * 1.5), host_budget=int(per_token * BLOCK * 1.5),
                   block_size=BLOCK)
    for mode, kw in MODES.items():
        path = Path(tempfile.mkdtemp(dir=SCRATCH)) / "kv"
        stage = "turn 0"
        try:
            with TieredStore(path, **budgets) as store:
                ids = ids_of(21, 1)
                cache = store.open(model, ids, session="s")
                got, _ = greedy(model, ids, past_key_values=cache)
                kept0 = cache.commit(got)
                ids = torch.cat([got, ids_of(6, 100)], dim=1)
                ids = torch.cat([ids, ids[:, 5:9]], dim=1)  # something for prompt lookup to find
                ids1 = ids
                torch.manual_seed(7)
                with torch.no_grad():
                    plain = model.generate(ids, max_new_tokens=NEW, **kw)
                stage = "turn 1 open"
                cache = store.open(model, ids, session="s")
                restored = sum(cache.restored_from.values())
                stage = "turn 1 generate"
                torch.manual_seed(7)
                with torch.no_grad():
                    mine = model.generate(ids, max_new_tokens=NEW, past_key_values=cache, **kw)
                if not torch.equal(mine, plain):
                    stage = "turn 1 control"
                    ctl = modes_control(model, ids, cache.restored_tokens, kw)
                    ctl = None if ctl is None else ctl[0]
                    cls = "drift" if ctl is not None and torch.equal(ctl, mine) else "WRONG"
                    out["modes"][mode] = (f"{cls} turn 1: tierkv {mine[:, -NEW:].tolist()} plain {plain[:, -NEW:].tolist()}"
                                          f" control {None if ctl is None else ctl[:, -NEW:].tolist()}")
                    continue
                stage = "turn 1 commit"
                restored1 = cache.restored_tokens
                cache.commit(mine[:1])
                ids = torch.cat([mine[:1], ids_of(5, 101)], dim=1)
                expected, _ = greedy(model, ids)
                stage = "turn 2"
                cache = store.open(model, ids, session="s")
                got, got_scores = greedy(model, ids, past_key_values=cache)
                cache.commit(got)
                if torch.equal(got, expected):
                    out["modes"][mode] = "exact"
                else:
                    stage = "turn 2 control"
                    second = turn2_control(model, ids1, ids, restored1, kept0, cache.restored_tokens, kw)
                    ctl = None if second is None else second[0]
                    cls = "drift" if ctl is not None and torch.equal(ctl, got) and \
                        logit_rel(got_scores, second[1]) <= CONTROL_TOL else "WRONG"
                    out["modes"][mode] = (f"{cls} turn 2 {got[:, -NEW:].tolist()} {expected[:, -NEW:].tolist()} control "
                                          f"{None if ctl is None else ctl[:, -NEW:].tolist()}")
                out["modes"][mode] += f" r{restored}"
        except Exception as e:
            where = "refused" if isinstance(e, (ValueError, TypeError)) and tierkv_frame(e) else "crash"
            out["modes"][mode] = f"{where} {stage}: {type(e).__name__}: {str(e)[:300]}"
    return out


def modes_control(model, ids, restored: int, kw: dict, head: int = 0):
    """Turn 1 of modes_one with no tierkv: turn 0's DynamicCache cropped to ``restored`` tokens (as
    ``control`` does for the greedy turns). Returns its sequences, the cache generate returned and
    turn 0's first ``head`` tokens' KV per layer; None where that cache cannot be cropped."""
    import torch
    caches: list = []
    try:
        greedy(model, ids_of(21, 1), cache_out=caches)
        cache = caches[-1]
        first = [(layer.keys[..., :head, :].clone(), layer.values[..., :head, :].clone()) for layer in cache.layers]
        if "prompt_lookup_num_tokens" in kw:
            # Assisted decoding feeds the whole prompt to whatever the cache holds (a DynamicCache
            # keeps both, the prompt's KV twice); tierkv drops its restore there, so the prompt is
            # computed afresh.
            restored = 0
        cache.crop(restored - cache.get_seq_length())
        if kw.get("num_beams", 1) > 1:
            cache.batch_repeat_interleave(kw["num_beams"])  # generate does not expand a cache handed to it
        torch.manual_seed(7)
        with torch.no_grad():
            r = model.generate(ids, max_new_tokens=NEW, past_key_values=cache, return_dict_in_generate=True, **kw)
        return r.sequences, r.past_key_values, first
    except Exception:
        return None


def turn2_control(model, ids1, ids2, restored1: int, kept0: int, restored2: int, kw: dict):
    """Turn 2 of modes_one with no tierkv: the KV tierkv holds for its first ``restored2`` tokens
    spliced from the two earlier turns' control caches, then greedy tokens from it. Turn 0's whole
    blocks come from turn 0 (a block is written once: turn 1, whose assisted decoding computed its
    prompt again, wrote none of them again), the rest from turn 1's row 0 (the rows are alike over
    the conversation; commit keeps nothing past it from several rows). Returns ``greedy``'s tokens and
    first logits; None where it cannot run."""
    import torch
    from transformers import DynamicCache
    cut = min(kept0 // BLOCK * BLOCK, restored2)
    ctl = modes_control(model, ids1, restored1, kw, head=cut)
    if ctl is None:
        return None
    _, later, first = ctl
    try:
        spliced = DynamicCache(config=model.config)
        for i, ((keys, values), layer) in enumerate(zip(first, later.layers)):
            spliced.update(torch.cat([keys, layer.keys[:1, ..., cut:restored2, :]], dim=-2),
                           torch.cat([values, layer.values[:1, ..., cut:restored2, :]], dim=-2), i)
        return greedy(model, ids2, past_key_values=spliced)
    except Exception:
        return None


def modes_worker(types: list[str]) -> None:
    out_dir = RESULTS.parent / "modes"
    out_dir.mkdir(parents=True, exist_ok=True)
    SCRATCH.mkdir(parents=True, exist_ok=True)  # a fresh SWEEP_RESULTS: every type crashed in mkdtemp
    signal.signal(signal.SIGALRM, alarm)
    for t in types:
        if (out_dir / f"{t}.json").exists():
            continue
        signal.alarm(TIMEOUT * 2)
        try:
            r = modes_one(t)
        except Exception as e:
            r = {"type": t, "modes": {"all": f"crash {type(e).__name__}: {str(e)[:300]}"}}
        finally:
            signal.alarm(0)
        (out_dir / f"{t}.json").write_text(json.dumps(r))
        bad = {m: v for m, v in r["modes"].items() if not v.startswith("exact")}
        print(f"{t:30} {'ok' if not bad else bad}", flush=True)


def alarm(*_):
    raise TimeoutError("sweep timeout")


def worker(types: list[str]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    SCRATCH.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGALRM, alarm)
    for t in types:
        (RESULTS / f"{t}.started").write_text("")
        signal.alarm(TIMEOUT)
        try:
            r = one(t)
        except TimeoutError:
            r = {"type": t, "cls": "crash", "why": f"timeout {TIMEOUT}s (hang?)"}
        finally:
            signal.alarm(0)
        (RESULTS / f"{t}.json").write_text(json.dumps(r))
        (RESULTS / f"{t}.started").unlink()
        print(f"{t:30} {r['cls']:8} {r.get('why', r.get('note', ''))[:150]}", flush=True)


def all_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def run(named: list[str]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    todo = named or [t for t in all_types() if not (RESULTS / f"{t}.json").exists()]
    chunk = 12
    while todo:
        batch, todo = todo[:chunk], todo[chunk:]
        subprocess.run([sys.executable, __file__, "worker", *batch])
        for t in batch:  # a worker that died (segfault, OOM) leaves its marker
            if (RESULTS / f"{t}.started").exists():
                (RESULTS / f"{t}.json").write_text(json.dumps({"type": t, "cls": "crash", "why": "process died"}))
                (RESULTS / f"{t}.started").unlink()
                rest = batch[batch.index(t) + 1:]
                todo = [x for x in rest if not (RESULTS / f"{x}.json").exists()] + todo


def table() -> None:
    rows = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))]
    by: dict[str, list] = {}
    for r in rows:
        by.setdefault(r["cls"], []).append(r)
    for cls, rs in sorted(by.items()):
        print(f"== {cls}: {len(rs)}")
        for r in rs:
            print(f"  {r['type']:28} {r.get('why', r.get('note', ''))[:220]}")


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    if cmd == "worker":
        worker(rest)
    elif cmd == "run":
        run(rest)
    elif cmd == "half":
        print(json.dumps(restart_half(*rest)))
    elif cmd == "modes":
        for i in range(0, len(rest), 12):
            subprocess.run([sys.executable, __file__, "modes_worker", *rest[i:i + 12]])
    elif cmd == "modes_worker":
        modes_worker(rest)
    elif cmd == "halves":
        halves(rest[0], rest[1:])
    elif cmd == "restart":
        restart_sweep(rest)
    elif cmd == "table":
        table()
    elif cmd == "one":
        SCRATCH.mkdir(parents=True, exist_ok=True)
        print(json.dumps(one(rest[0]), indent=1))
