"""The model a benchmark replays its trace on: a checkpoint of the user's (``--model``), or a
random one of a transformers family (``--arch``, default llama) sized by ``--layers`` and
``--hidden``, in ``--dtype``.

Protocol: ``add_model_flags(parser)`` adds the flags; ``check_model_flags(parser, args, ...)``
refuses bad combinations through ``parser.error`` before anything is built; ``build_model(args,
device, context)`` returns the model in eval mode on ``device``, or raises ``ModelFlagError``
with a message saying what to give instead (a checkpoint that cannot be loaded, a family that is
not a causal LM or cannot be built at the flags, one the flags size only in part or that embeds
images or audio: counted and checked on the meta device first, a context past the model's
positions). ``kv_bytes_per_token(model)`` measures what one token's KV weighs in the model's own
cache (every layer's keys and values), so that the trace's working set and percentage budgets hold
for any family and dtype (the bench adds the zeroed unit a store's blocks may carry:
``bench.stored_bytes_per_token``). ``describe(model)`` is the one line the reports print.

Random models draw their token ids from ``[3, vocab)``: ids 0-2 are their pad, bos and eos
(a family's own defaults, e.g. Phi-3's pad 32000, lie past a 4096-token vocabulary). A global
sliding window is switched off (so that ``--arch mistral`` replays the full attention the other
families do; a checkpoint keeps its own window); families whose layers alternate between sliding
and full attention (``layer_types``) are left as they are. A random model's head_dim is 64, and a
family's layers that set their own (Gemma 4's full-attention ones) keep its ratio to it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, DynamicCache, PretrainedConfig

from .cache import _WITHOUT_TIERKV, _refuse_unsupported
from .interrupts import raised_by_signal_handler

#: ``--dtype``'s names.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: A random model's vocabulary.
RANDOM_VOCAB = 4096


class ModelFlagError(ValueError):
    """The model flags name no model the trace can run; the message says what to give instead."""


#: What a refusal of ``--arch`` tells to give instead.
OTHER_ARCH = "give another --arch, such as llama, qwen2, mistral, gpt2, gpt_neox, opt or phi"


def cannot_serve(exc: ValueError, instead: str = OTHER_ARCH) -> ModelFlagError:
    """store.open's refusal of a model, as the benchmarks word it: the library's way out (generate
    without a TieredCache) is no flag of theirs; the way out there is another model."""
    return ModelFlagError(f"tierkv cannot serve this model: {str(exc).removesuffix(_WITHOUT_TIERKV)}; {instead}")


def add_model_flags(parser: argparse.ArgumentParser, layers: int, hidden: int) -> None:
    """``--model``, ``--arch``, ``--layers``, ``--hidden`` and ``--dtype``. The size flags default
    to None, so that ``check_model_flags`` can tell them given from left out."""
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="a checkpoint to replay the trace on: a directory written by save_pretrained (or a "
                             "Hub id, where the network allows), loaded with AutoModelForCausalLM; default: a random "
                             "model of --arch")
    parser.add_argument("--arch", default=None, metavar="TYPE",
                        help="the random model's family, a transformers model_type such as llama, qwen2, mistral, "
                             "gpt2, gpt_neox, opt, phi, gemma (default: llama)")
    parser.add_argument("--layers", type=int, default=None, help=f"the random model's layers (default: {layers})")
    parser.add_argument("--hidden", type=int, default=None,
                        help=f"the random model's hidden size, 64 or a multiple of 128 (default: {hidden})")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES),
                        help="the model's dtype, and its KV's (default: %(default)s)")


def check_model_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, layers: int, hidden: int) -> None:
    """Refuse size flags beside ``--model`` (a checkpoint has its own) and bad sizes; fill in the
    random model's defaults."""
    if args.model is not None:
        given = [f"--{name}" for name in ("arch", "layers", "hidden") if getattr(args, name) is not None]
        if given:
            verb = "describes" if len(given) == 1 else "describe"
            parser.error(f"{', '.join(given)} {verb} the random model, and --model {args.model!r} has its own "
                         "family and size: leave them out, or leave out --model")
        if not args.model.strip():
            parser.error("--model was given an empty name (an unset variable?); give a checkpoint directory, or "
                         "leave --model out for a random model")
        return
    args.arch = "llama" if args.arch is None else args.arch
    args.layers = layers if args.layers is None else args.layers
    args.hidden = hidden if args.hidden is None else args.hidden
    if args.arch not in CONFIG_MAPPING:
        parser.error(f"--arch {args.arch!r} is not a transformers model type; give one such as llama, qwen2, mistral, "
                     "gpt2, gpt_neox, opt, phi or gemma")
    if args.layers < 1:
        parser.error(f"--layers must be 1 or more, got {args.layers}")
    if not (args.hidden == 64 or (args.hidden > 0 and args.hidden % 128 == 0)):
        parser.error(f"--hidden must be 64 or a positive multiple of 128 (the model has hidden/64 query heads "
                     f"sharing hidden/128 KV heads), got {args.hidden}")


def build_model(args: argparse.Namespace, device: torch.device, context: int, flag: str = "--context",
                generated: int = 0) -> torch.nn.Module:
    """The trace's model, seeded by ``args.seed`` where random, in eval mode on ``device``. It must
    take ``context`` positions, ``flag``'s value and ``generated`` tokens more: a checkpoint's config
    is read and checked before its weights."""
    dtype = DTYPES[args.dtype]
    if args.model is not None:
        model = _load_checkpoint(args.model, dtype, context + generated, flag, generated)
    else:
        model = _random_model(args.arch, args.layers, args.hidden, context, args.seed, dtype)
    return model.to(device).eval()


def _load_checkpoint(name: str, dtype: torch.dtype, context: int, flag: str, generated: int) -> torch.nn.Module:
    path = Path(name).expanduser()
    if path.is_file():
        raise ModelFlagError(f"--model {name!r} is a file: give the directory save_pretrained wrote (the model's "
                             "config.json and weights)")
    if path.exists() and not (path / "config.json").is_file():
        raise ModelFlagError(f"--model {name!r} holds no config.json: give a directory written by save_pretrained "
                             "(the model's config and weights)")
    if not path.exists() and (path.is_absolute() or name.startswith((".", "~"))):
        # A path, not a Hub id ("org/name"): asking the Hub for it would only add a confusing error.
        raise ModelFlagError(f"--model {name!r}: no such directory; give a directory written by save_pretrained")
    source = str(path) if path.exists() else name
    try:
        config = AutoConfig.from_pretrained(source)
        limit = getattr(config.get_text_config(), "max_position_embeddings", None)
        if isinstance(limit, int) and context > limit:
            with_generated = f", with the {generated} generated" if generated else ""
            raise ModelFlagError(f"{flag} {context - generated} is past the {limit} positions the model takes "
                                 f"(max_position_embeddings{with_generated}): give {flag} {limit - generated} or less")
        return AutoModelForCausalLM.from_pretrained(source, config=config, dtype=dtype)
    except ModelFlagError:
        raise
    except (OSError, ValueError, ImportError, KeyError) as exc:
        if raised_by_signal_handler(exc):
            raise  # a SIGALRM timeout's, as the files were read: not a checkpoint that cannot be loaded
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelFlagError(f"--model {name!r} could not be loaded as a causal language model ({reason}); give a "
                             "directory written by save_pretrained, or the Hub id of a decoder-only model") from None


def _random_model(arch: str, layers: int, hidden: int, context: int, seed: int, dtype: torch.dtype
                  ) -> torch.nn.Module:
    # The generic names: families that call them otherwise (GPT-2's n_embd, n_layer) map them.
    fields = dict(vocab_size=RANDOM_VOCAB, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                  num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128),
                  max_position_embeddings=context + 64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config = _config(arch, fields)
    nested = getattr(config, "text_config", None)
    # Read from its dict: a field its layers set otherwise (Gemma 4's head_dim) raises when read
    # from the config itself.
    declared = nested.to_dict() if isinstance(nested, PretrainedConfig) else {}
    if isinstance(nested, PretrainedConfig) and \
            [key for key in ("hidden_size", "num_hidden_layers", "vocab_size") if declared.get(key) != fields[key]]:
        # A family whose causal LM reads a text config inside its own (Llama 4's, Qwen 3.5's, the
        # multimodal ones): the flags size that one. Set on the outer config alone, they left it as the
        # family's checkpoints have it: `--arch llama4` built 48 layers 5120 wide, and `--arch qwen3_5`
        # a 248,320-id embedding 4096 wide, for minutes, before store.open refused or ran it. Any of
        # its sizes, not its width alone: at --hidden 4096, Qwen 3.5's own, its 32 layers and
        # 248,320 ids were left so (h129).
        text_fields = dict(fields)
        if declared.get("head_dim") not in (None, 64) and not getattr(nested, "is_heterogeneous", False):
            text_fields["head_dim"] = 64
        config = _config(arch, fields, text_config=text_fields)
        _shape(config.text_config, layers, hidden)
        return _build(arch, config, dtype, seed, fields)
    if getattr(config, "is_heterogeneous", False):
        # A field some layers set otherwise (Gemma 4's head_dim, 512 in its full-attention layers)
        # raises when read from the config itself (`--arch gemma4_text` died there): read from its
        # dict, and the layers' own head_dims scaled alike (Gemma 4's full-attention layers then
        # 128, twice the others', as 512 is 256's), so the model keeps its KV of other shapes.
        declared = config.to_dict()
        base = declared.get("head_dim")
        if isinstance(base, int) and base != 64:
            per_layer = {layer: {**fields_of, "head_dim": fields_of["head_dim"] * 64 // base}
                         if isinstance(fields_of.get("head_dim"), int) else fields_of
                         for layer, fields_of in (declared.get("per_layer_config") or {}).items()}
            config = _config(arch, fields, head_dim=64, per_layer_config=per_layer)
    elif getattr(config, "head_dim", 64) != 64:  # Gemma's 256 by default; Falcon's is a property, always 64 here
        config.head_dim = 64
    _shape(config, layers, hidden)
    return _build(arch, config, dtype, seed, fields)


def _unbuildable(arch: str, fields: dict[str, Any], exc: BaseException) -> ModelFlagError:
    # Every line: huggingface_hub's validation errors name the validator on the first and the
    # reason on the next.
    reason = " ".join([line.strip() for line in str(exc).strip().splitlines() if line.strip()]) or "no message"
    return ModelFlagError(f"--arch {arch!r} could not be built at --layers {fields['num_hidden_layers']} --hidden "
                          f"{fields['hidden_size']} ({type(exc).__name__}: {reason[:200]}); {OTHER_ARCH}")


def _config(arch: str, fields: dict[str, Any], **more: Any) -> Any:
    """The family's config with the flags' fields; ``ModelFlagError`` where the family refuses
    them (huggingface_hub's validation of its fields and architecture, a field it will not take:
    a traceback before, h129)."""
    try:
        return AutoConfig.for_model(arch, **fields, **more)
    except Exception as exc:
        if raised_by_signal_handler(exc):
            raise  # a SIGALRM timeout's, as the config was made: not a family that refuses the flags
        raise _unbuildable(arch, fields, exc) from None


def _shape(config: Any, layers: int, hidden: int) -> None:
    """The family's other defaults that the flags' sizes leave out of scale (of the text config,
    in a config that nests one)."""
    shared = getattr(config, "num_kv_shared_layers", None)
    if isinstance(shared, int) and shared > layers // 2:
        # KV sharing (Gemma 3n's last 15 of 35 layers read the KV of earlier ones): at most half
        # the layers, as the family's checkpoints share, so some layers make KV for them (at 4
        # layers Gemma 3n's 15 left none, and `--arch gemma3n_text` was refused as no causal LM).
        config.num_kv_shared_layers = layers // 2
    if isinstance(getattr(config, "vocab_size_per_layer_input", None), int):
        # Per-layer input embeddings (Gemma 3n's, Gemma 4's) of the family's 262,144 ids: 268M
        # parameters at 4 layers of --hidden 128, where the model has 2M besides.
        config.vocab_size_per_layer_input = RANDOM_VOCAB
    if getattr(config, "sliding_window", None) is not None and getattr(config, "layer_types", None) is None:
        try:
            config.sliding_window = None
        except Exception as exc:
            # A config whose validation takes no None there (Moshi's) keeps its window, as a
            # checkpoint does: served or refused by store.open for what it is (its traceback before, h129).
            if raised_by_signal_handler(exc):
                raise
    if getattr(config, "kv_lora_rank", None):
        # Latent attention expands the latent to every query head's keys and values (DeepSeek's
        # num_key_value_heads is its heads'): fewer made its attention's shapes disagree.
        config.num_key_value_heads = config.num_attention_heads
    _shrink_experts(config, hidden)


#: A random model refused as out of scale past this many times a llama of the same flags, and
#: past this many parameters (4 GiB in float32): a family whose sub-configs the flags do not reach.
OUT_OF_SCALE = 32
OUT_OF_SCALE_PARAMETERS = 10**9


def _build(arch: str, config: Any, dtype: torch.dtype, seed: int, fields: dict[str, Any]) -> torch.nn.Module:
    _refuse_on_meta(arch, config, dtype, fields)
    torch.manual_seed(seed)
    try:
        return AutoModelForCausalLM.from_config(config, dtype=dtype)
    except ValueError as exc:  # not a family with a causal LM head (BERT without is_decoder, T5, ...)
        if raised_by_signal_handler(exc):
            raise
        reason = str(exc).strip().splitlines()[0]
        raise ModelFlagError(f"--arch {arch!r} has no causal language model to build ({reason[:200]}); give a "
                             "decoder-only family such as llama, qwen2, mistral, gpt2, gpt_neox, opt or phi") from None
    except Exception as exc:
        # transformers' own defaults that do not build (DBRX's attention config without the
        # rope_theta its attention reads, MusicGen's without dropout): a traceback before (h129).
        if raised_by_signal_handler(exc):
            raise
        raise _unbuildable(arch, fields, exc) from None


def _refuse_on_meta(arch: str, config: Any, dtype: torch.dtype, fields: dict[str, Any]) -> None:
    """``ModelFlagError`` for a family the flags size only in part, counted on the meta device
    (no memory, a fraction of a second): BLT's byte encoder, decoder, global transformer and
    patcher are configs of their own, and ``--arch blt`` built 4.6 billion parameters (18 GiB,
    minutes) before store.open could refuse or run it (h129). So too for a family that embeds
    images or audio, which store.open refuses for that (``cache._refuse_unsupported``): its
    towers are not sized by the flags either (Gemma 3's 94M-parameter vision tower, Phi-4's
    multimodal model 20 s to build). A family that fails to build there is left to the real
    build, which says why."""
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
            n = sum(p.numel() for p in model.parameters())
            llama = sum(p.numel() for p in AutoModelForCausalLM.from_config(
                AutoConfig.for_model("llama", **fields)).parameters())
    except Exception as exc:
        if raised_by_signal_handler(exc):
            raise
        return
    if n > max(OUT_OF_SCALE * llama, OUT_OF_SCALE_PARAMETERS):
        text = config.get_text_config(decoder=True)
        subs = [name for name, value in vars(config).items()
                if isinstance(value, PretrainedConfig) and value is not text]
        unsized = f"its {', '.join(subs)} {'is' if len(subs) == 1 else 'are'}" if subs else "its own defaults are"
        gib = n * torch.empty(0, dtype=dtype).element_size() / 2**30
        raise ModelFlagError(f"--arch {arch!r} builds {n / 1e6:,.0f}M parameters at --layers "
                             f"{fields['num_hidden_layers']} --hidden {fields['hidden_size']}, {n / llama:,.0f} "
                             f"times a llama of those flags ({gib:,.1f} GiB): {unsized} not sized by --layers and "
                             f"--hidden; {OTHER_ARCH}")
    try:
        _refuse_unsupported(model, model.config, model.config.get_text_config(decoder=True))
    except ValueError as exc:
        if raised_by_signal_handler(exc):
            raise
        raise cannot_serve(exc) from None


def _shrink_experts(config: Any, hidden: int) -> None:
    """A MoE family's default experts are a real checkpoint's (DeepSeek-V3's 256 of 2,048 wide,
    Qwen2-MoE's 60): at ``--hidden 512`` and 4 layers they made 840M and 560M parameters, nearly
    all in experts, where a Llama of the same flags has 14M. At most 8 experts (2 a token), as
    wide as the dense MLP, in one routing group; the attention and its KV are left as the family
    makes them."""
    counts = [key for key in ("n_routed_experts", "num_experts", "num_local_experts")
              if isinstance(getattr(config, key, None), int) and not isinstance(getattr(config, key), bool)]
    if not counts:
        return
    for key in counts:
        setattr(config, key, min(getattr(config, key), 8))
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > hidden * 2:
            setattr(config, key, hidden * 2)
    top = getattr(config, "num_experts_per_tok", None)
    if isinstance(top, int) and top > 2:
        config.num_experts_per_tok = 2
    for key in ("n_group", "topk_group"):
        if isinstance(getattr(config, key, None), int):
            setattr(config, key, 1)


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """One token's KV in the model's own cache, every layer's keys and values, from a two-token
    forward (no family's config arithmetic to get wrong: GQA, MQA, head_dim, dtype)."""
    device = next(model.parameters()).device
    probe = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([[3, 4]], device=device), past_key_values=probe, use_cache=True)
    total = sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
                for layer in probe.layers if layer.keys is not None)
    return total // 2


def vocab_of(model: torch.nn.Module) -> int:
    """The ids the trace may draw from: below both the embeddings' rows and the config's vocabulary."""
    rows = model.get_input_embeddings().num_embeddings
    declared = getattr(model.config.get_text_config(), "vocab_size", None)
    return min(rows, declared) if isinstance(declared, int) else rows


def describe(model: torch.nn.Module, source: str | None) -> str:
    """``llama (random) 4 layers hidden 512, float32, 13.0M parameters``, or the checkpoint's path."""
    config = model.config.get_text_config()
    layers = getattr(config, "num_hidden_layers", "?")
    hidden = getattr(config, "hidden_size", "?")
    params = sum(p.numel() for p in model.parameters())
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    origin = f"{source}" if source is not None else "(random)"
    return f"{config.model_type} {origin} {layers} layers hidden {hidden}, {dtype}, {params / 1e6:.1f}M parameters"
