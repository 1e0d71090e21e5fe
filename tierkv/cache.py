"""``TieredCache``: one conversation's KV cache, as a ``transformers.Cache``.

The only module that imports transformers. It adapts a model and a conversation to the store
and holds no policy:

* ``describe_model(model)`` checks that the model is a decoder-only, text-only model of
  full-attention or sliding-window layers whose keys and values share one shape, and computes its
  fingerprint: architecture fields of its config, dtype, the code that computes its KV (torch and transformers releases, device
  kind, GPU model, a CPU's vector code: ``_kernels_tag``), a digest of every byte of its weights (``weights.py``)
  and of its RoPE frequencies' values (not under dynamic RoPE). The checks and the config digest
  are cached per model object (moving the model rebuilds them); the weight sample is read on
  every call, and the full digest is computed again whenever the sample or a parameter's version
  counter moved, so weights changed in place never meet KV computed with the old ones. Read on
  every call too: the attention implementation where it is not sdpa, the MoE experts'
  implementation where it is not grouped_mm, torch's matmul precision where it is not the default
  (``_matmul_precision``: TF32, bf16), and which adapters peft's
  layers apply (a cache's first forward checks those again). Weights the fingerprint cannot read
  (torch's quantised modules), a model on the meta device and one whose forward hands an inner
  model the cache by position (read from its source: the hook cannot check such a call) are
  refused. RoPE recomputed from
  each forward's length (dynamic NTK, longrope) gives the model a ``position_limit``: the store
  restores and keeps KV within it only.
* ``describe_model`` also puts a forward pre-hook on the model (``_check_forward``), which does
  nothing unless a call passes a ``TieredCache``. While the cache holds less than its
  conversation, a forward must be fed the conversation's next ids (every row alike: beams) at
  their own positions, not ``inputs_embeds`` nor ``token_type_ids``, under at most a 2-D mask;
  an ``attention_mask`` that hides a token ends what ``commit`` keeps there, and one that hides
  a restored token is refused. Past the conversation the ids fed are noted, with whether the
  mask hid a token and the positions given (copies, no device sync), and ``commit`` keeps what
  was computed from known ids, unmasked, at their own positions, if they are the sequences it
  is given; forwards in several rows there (samples, beams) keep none. A mask must cover the
  cache and the new ids. A model in training mode (dropout) and a forward under autocast (KV
  in other dtypes than the weights') are refused. ``generate`` feeds
  a pre-filled cache only the ids past it; the whole ids it hands ``prepare_inputs_for_generation``
  are checked there against those the cache holds KV for, by a wrapper ``describe_model`` keeps
  on the model's class (``_install_checked_prepare``: nothing per model object, so copies and
  pickles of the model are unaffected). Ids edited inside the restored prefix and fed to the
  model directly are caught at ``commit``. ``ModelInfo.masked_token`` (the pad id ``generate`` masks) ends what
  ``open`` restores and ``commit`` keeps wherever it appears. A forward that raised part-way
  through the layers (out of memory, Ctrl-C) left the first layers ahead of the last: any forward
  after it is refused, and ``commit`` keeps what every layer holds (``held_tokens``). A cache that holds every id of its
  conversation is refused those ids fed again (``generate`` feeds them all to such a cache), unless
  ``generate`` took them from past the cache (its prefill, decode steps, assisted decoding's
  candidates: ``_check_generate_ids``), where a reply may repeat the conversation.
* ``token_ids_of(input_ids)`` validates a ``(1, L)`` integer tensor and returns int64 numpy ids.
* ``TieredCache`` is built by ``TieredStore.open`` with the restored blocks as jobs. Layer ``i``
  waits for them (on CUDA: orders its stream after layer ``i``'s own copies, no host sync) and
  assembles its keys and values only when the model first touches layer ``i`` (``update``,
  ``keys``, crop...), so restores overlap with the prefill of earlier layers. The first
  ``update`` concatenates the restored blocks and the new tokens in one copy, keys and values
  together (a block holds a layer's keys and values side by side): the layer's keys and values
  are the two contiguous halves of that one tensor. A restore that ``open`` read from disk into
  a buffer of its own (on CPU, blocks no memory tier keeps: ``restore_slots``; each layer's part
  from its window's cut) is assembled in that buffer instead: the first ``update`` that brings
  exactly the conversation's remaining tokens in one row, with autograd off (``generate`` runs
  under ``no_grad``), writes them into the room left for them, and any other first access copies
  the prefix out as before.
  ``commit(sequences)`` hands the KV back to the store.

Generation details handled here:
* beam search and ``num_return_sequences`` expand the batch after the cache was filled: a batch-1
  layer is repeated to the incoming batch on its first update;
* a later ``generate`` on the same cache first drops the KV its ids and mask cannot vouch for
  (several rows past the conversation, ids fed unknown, tokens its mask hides) and cuts several
  rows to one (``_drop_unverified``, from the wrapper of generate's prefill stage);
* assisted decoding (``prompt_lookup_num_tokens``, assistant models) re-feeds the whole prompt on
  its first forward in transformers 5.x whatever the cache holds, and announces itself through
  ``activate_past_recording``; the cache then drops what it restored, so the prompt is recomputed
  once and the output stays exact. GPT-2 built with ``add_cross_attention`` wraps the cache in an
  ``EncoderDecoderCache``, which assisted decoding crops: its check that the wrapped cache is a
  ``DynamicCache`` accepts a ``TieredCache`` too (``_install_tiered_self_attention``).
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import json
import logging
import os
import re
import sys
import textwrap
import threading
import time
import types
import warnings
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
import xxhash
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DummyLayer, DynamicCache, DynamicLayer, EncoderDecoderCache

try:
    from transformers.cache_utils import get_layer_types_and_kwargs
except ImportError:  # transformers before 5.x's per-layer config API
    get_layer_types_and_kwargs = None

from .codec import CorruptRecord
from .interrupts import raised_by_signal_handler
from .layout import KVLayout
from .staged import StagedTokens
from .transfer import Job, _CudaCopyJob
from .weights import BufferDigests, WeightSample, digest_weights, versions

if TYPE_CHECKING:
    from .store import TieredStore

logger = logging.getLogger("tierkv")

# Config fields that do not change the keys and values a model computes.
_CONFIG_FIELDS_IGNORED = frozenset({
    "_name_or_path", "name_or_path", "transformers_version", "architectures", "torch_dtype", "dtype",
    "use_cache", "return_dict", "output_attentions", "output_hidden_states", "id2label", "label2id",
    "_attn_implementation", "_attn_implementation_autoset", "_experts_implementation", "_commit_hash",
    "_attn_implementation_internal", "_experts_implementation_internal",  # read live, see describe_model
    "tokenizer_class", "pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id",
    "decoder_start_token_id", "task_specific_params", "problem_type", "prefix", "finetuning_task",
    "chunk_size_feed_forward", "tie_word_embeddings", "torchscript", "pruned_heads",
})


@dataclass(slots=True, frozen=True)
class ModelInfo:
    fingerprint: bytes
    num_layers: int
    device: torch.device
    dtype: torch.dtype
    # The dtype its layers compute KV in (_kv_dtype): the first parameter's (dtype), unless the
    # model keeps some weights in another (transformers' _keep_in_fp32_modules).
    kv_dtype: torch.dtype
    # RoPE whose frequencies depend on the length of the forward pass ("dynamic" NTK, "longrope"):
    # the longest sequence whose every forward uses the base frequencies. KV is restored and kept
    # only within it; None when the frequencies are fixed.
    position_limit: int | None = None
    # The pad id generate() masks wherever it appears (one that is not an eos id), or None: KV
    # computed while it was not masked (a reply that generated it) is not kept past it.
    masked_token: int | None = None
    # Which peft adapters the model applied, and how, when the fingerprint was taken (b"" without
    # peft layers): a cache's first forward checks that they are still the same.
    adapters: bytes = b""
    attention: str | None = None  # config._attn_implementation when the fingerprint was taken
    experts: str | None = None  # the MoE experts' implementation then (_experts_of); None without experts
    precision: str | None = None  # _matmul_precision then: None at torch's defaults
    switches: str | None = None  # _kernel_switches then: None at torch's defaults
    vocab: int | None = None  # rows of the input embedding: ids from this on have no embedding
    # RoBERTa's family: a forward given no position_ids counts positions from the pad id + 1,
    # where generate() passes them counted from 0 (see _check_inputs).
    positions_from_pad: bool = False
    # Which sampled parameters the fingerprint read (its WeightSample's id) and their version
    # counters then: a forward that finds either moved takes the fingerprint again.
    weights_state: tuple[int, tuple[int, ...] | None] | None = None
    windows: tuple[int | None, ...] = ()
    cut_layers: str = "sliding-window"  # what its windowed layers are, as a crop's refusal names them
    # Where each layer's keys and values lie in a block, for layers of other KV shapes (layout.py);
    # None where they are all of one shape, a slot a layer.
    layout: KVLayout | None = None
    config_digest: bytes = b""  # _Static's then: a forward finding another refuses (check_computed_as_opened)


@dataclass(slots=True)
class _Weights:
    """A digest of every weight byte, and what it was computed from: it is computed again when
    the sampled values or the parameters' version counters move."""

    sample: bytes
    versions: tuple[int, ...] | None
    digest: bytes


@dataclass(slots=True)
class _Static:
    """What does not change while a model object lives: architecture facts and sample points."""

    config_digest: bytes
    num_layers: int
    sample: WeightSample
    position_limit: int | None
    vocab: int | None = None
    positions_from_pad: bool = False
    # The configs the model's MoE experts modules dispatch on (see _experts_of).
    experts_configs: tuple[Any, ...] = ()
    # The config the digest was taken from, its text config, the fields the digest covers, and
    # all the config's fields as last seen (with no covered field changed).
    config: Any = None
    text_config: Any = None
    config_seen: dict[str, Any] = field(default_factory=dict)
    config_raw: dict[str, Any] = field(default_factory=dict)
    # The classes of the model and of the transformers models inside it whose
    # prepare_inputs_for_generation describe_model keeps checked (_install_checked_prepare).
    prepare_classes: tuple[type, ...] = ()
    kv_dtype: torch.dtype | None = None  # see _kv_dtype
    windows: tuple[int | None, ...] = ()
    cut_layers: str = "sliding-window"  # see _cut_layers
    layout: KVLayout | None = None  # see _kv_layout

    def config_current(self, model: Any) -> bool:
        """Whether the fields the config digest covers are as they were when it was taken (a
        field edited on the live config changes the KV of this model object: X-MOD's
        set_default_language, clip_qkv set by hand). One comparison of the whole config, 1 us;
        get_text_config alone takes 17."""
        config = model.config
        if config is self.config and vars(config) == self.config_raw:
            return True
        text = config.get_text_config(decoder=True)
        if text is not self.text_config or _covered(text) != self.config_seen:
            return False
        self.config, self.config_raw = config, _snapshot(vars(config))  # an ignored field changed
        return True
    weights: _Weights | None = None
    adapters: tuple["weakref.ref[torch.nn.Module]", ...] = ()  # peft's adapter layers (_adapter_layers)
    buffers: BufferDigests = field(default_factory=BufferDigests)  # RoPE's frequencies' values


_static_cache: "weakref.WeakKeyDictionary[torch.nn.Module, _Static]" = weakref.WeakKeyDictionary()
_describe_lock = threading.Lock()


def _layer_types(text_config: Any) -> list[str]:
    """Each layer's attention type, as transformers' own caches would build it."""
    types = _declared_layer_types(text_config)
    decoder = getattr(text_config, "decoder_layers", None)
    if isinstance(decoder, int) and not isinstance(decoder, bool) and decoder != len(types) and len(set(types)) == 1:
        # The decoder alone (BartForCausalLM, Blenderbot's, Marian's...): its config maps
        # num_hidden_layers to encoder_layers, which the model built without this decoder.
        types = types[:1] * decoder
    return types


def _declared_layer_types(text_config: Any) -> list[str]:
    if get_layer_types_and_kwargs is not None:
        return list(get_layer_types_and_kwargs(text_config)[0])
    # As transformers' caches read an old config without layer_types: a window first, then a chunk.
    kind = "sliding_attention" if getattr(text_config, "sliding_window", None) else \
        "chunked_attention" if getattr(text_config, "attention_chunk_size", None) else "full_attention"
    types = list(getattr(text_config, "layer_types", None) or [kind] * text_config.num_hidden_layers)
    shared = getattr(text_config, "num_kv_shared_layers", 0) or 0
    return types[: len(types) - shared] + ["dummy"] * shared


#: The layer types a sliding window serves, and the config field that sizes each one's window.
#: Chunked attention (Llama 4's) is a window to transformers' caches: a ``DynamicSlidingWindowLayer``
#: of ``attention_chunk_size`` tokens, whose last ``chunk - 1`` hold every token of the current
#: chunk; its mask alone restarts at each chunk. Served as the window it is to the cache.
WINDOWED = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size"}


def _windows(text_config: Any, layer_types: list[str]) -> tuple[int | None, ...]:
    """Each layer's sliding window (a chunked layer's: its chunk), as transformers' caches size it,
    or None for full attention."""
    if not set(layer_types) & set(WINDOWED):
        return (None,) * len(layer_types)
    per_layer = get_layer_types_and_kwargs(text_config)[1] if get_layer_types_and_kwargs is not None else []
    windows: list[int | None] = []
    for i, kind in enumerate(layer_types):
        field = WINDOWED.get(kind)
        if field is None:
            windows.append(None)
            continue
        window = per_layer[i].get("sliding_window") if i < len(per_layer) else getattr(text_config, field, None)
        windows.append(_window(window, kind, field))
    return tuple(windows)


def _window(window: Any, kind: str = "sliding_attention", field: str = "sliding_window") -> int:
    # A window of 1 (each token attending to itself alone): transformers' DynamicSlidingWindowLayer
    # keeps every token then (its slice [-0:]) while its mask sizes say none, so plain generate
    # itself computes no such model as it was trained.
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        what = "chunk" if kind == "chunked_attention" else "window"
        raise ValueError(f"the model's config has {kind} layers with {field}={window!r}; "
                         f"tierkv needs a {what} of at least 2 tokens (an int): give the {what} the checkpoint "
                         "was trained with")
    return window


def _position_limit(text_config: Any) -> int | None:
    """For RoPE recomputed from the length of each forward pass, the longest sequence computed
    with the base frequencies throughout (transformers' ``dynamic_rope_update``): "longrope"
    switches to its long factors past ``original_max_position_embeddings``; dynamic NTK rescales
    past ``max_position_embeddings`` and, having grown, resets only below it. A prefix computed
    short and restored into a longer conversation would not equal the longer prefill."""
    params = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None)
    if not isinstance(params, dict):
        return None
    variants = [params] if "rope_type" in params or "type" in params else \
        [v for v in params.values() if isinstance(v, dict)]  # per layer type
    limits = []
    for v in variants:
        kind = str(v.get("rope_type", v.get("type", "default")))
        top = getattr(text_config, "max_position_embeddings", None)
        original = v.get("original_max_position_embeddings") or getattr(text_config, "original_max_position_embeddings",
                                                                        None)
        if kind == "longrope":
            limits.append(int(original or top))
        elif "dynamic" in kind and top:
            # Every rotary class resets below max_position_embeddings itself (original_max_seq_len).
            limits.append(int(top) - 1)
    return min(limits) if limits else None


def _masked_token(model: Any) -> int | None:
    """The pad id ``generate`` masks by default: its generation config's, unless that is an eos id."""
    config = getattr(model, "generation_config", None)
    pad, eos = getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)
    eos_ids = eos if isinstance(eos, (list, tuple)) else [eos]
    return pad if isinstance(pad, int) and pad not in eos_ids else None


#: The way out, for a model tierkv refuses to serve: nothing of the store is needed to generate.
_WITHOUT_TIERKV = (". Generate with it without a TieredCache (model.generate() with no cache=), or serve a "
                   "decoder-only model of full-attention or sliding-window layers (Llama, Mistral, Gemma 3...) "
                   "through tierkv")


def _kv_layout(text_config: Any, layer_types: list[str]) -> KVLayout | None:
    """How a block holds the layers' keys and values where the config sets KV heads or head_dim
    per layer (``per_layer_config``: Gemma 4's full-attention layers, head_dim 512 where its
    sliding ones have 256), some layers hold none (KV sharing: ``"dummy"`` layers) or keys and
    values differ (multi-head latent attention), or None where every layer holds keys and values
    of one shape (or the config does not say: the first forward's ``_check_kv_shape`` then
    refuses layers of other shapes)."""
    dummies = "dummy" in layer_types
    if getattr(text_config, "is_heterogeneous", False):
        configs = list(text_config.per_layer_config)
    elif dummies or getattr(text_config, "kv_lora_rank", None):
        configs = [text_config] * len(layer_types)
    else:
        return None
    shapes: list[tuple[Any, ...] | None] = []
    for kind, config in zip(layer_types, configs):
        rank = getattr(config, "kv_lora_rank", None)
        if kind == "dummy":
            shapes.append(None)
            continue
        if rank:
            # transformers' latent attention caches, one head each, the compressed latent as keys
            # and the rotary keys as values (DeepseekV3Attention.forward and its kin).
            shapes.append((1, rank, 1, getattr(config, "qk_rope_head_dim", None)))
            continue
        heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
        dim = getattr(config, "head_dim", None)
        if dim is None and isinstance(heads, int) and isinstance(getattr(config, "hidden_size", None), int):
            dim = config.hidden_size // config.num_attention_heads
        shapes.append((heads, dim))
    known = len(configs) == len(layer_types) and all([
        shape is None or all([isinstance(n, int) and n > 0 for n in shape]) for shape in shapes])
    if not known:
        if dummies:
            raise ValueError(f"{type(text_config).__name__} shares KV between layers (num_kv_shared_layers="
                             f"{getattr(text_config, 'num_kv_shared_layers', None)}), and tierkv cannot read the KV "
                             "heads and head_dim of the layers that hold it from the config (num_key_value_heads, "
                             f"head_dim){_WITHOUT_TIERKV}")
        return None
    return KVLayout.of(shapes)


def _kv_shape_fields(text_config: Any, layer_idx: int) -> str:
    """The config fields that set layer ``layer_idx``'s keys' and values' shape in its layout, as
    ``_kv_layout`` reads them, with their values: ``kv_lora_rank`` and ``qk_rope_head_dim`` for
    latent attention; else its KV heads and head_dim. A field a heterogeneous config sets per
    layer (Gemma 4's full-attention head_dim) is named as ``per_layer_config[i].field``. For a
    refusal's message: it names what to look at in this model's config."""
    heterogeneous = getattr(text_config, "is_heterogeneous", False)
    config = text_config.per_layer_config[layer_idx] if heterogeneous else text_config
    if getattr(config, "kv_lora_rank", None):
        names = ["kv_lora_rank", "qk_rope_head_dim"]
    else:
        names = ["num_key_value_heads" if getattr(config, "num_key_value_heads", None) else "num_attention_heads",
                 "head_dim" if getattr(config, "head_dim", None) is not None else "hidden_size"]
    # The layers' own settings, where transformers keeps them (5.25: a global head_dim, Gemma 4's
    # sliding layers', reads as ambiguous however many layers set their own).
    overrides = getattr(getattr(text_config, "_heterogeneity_spec", None), "per_layer_overrides", None)
    fields = []
    for name in names:
        value = getattr(config, name, None)
        per_layer = False
        if heterogeneous and isinstance(overrides, Mapping):
            per_layer = name in overrides.get(layer_idx, {})
        elif heterogeneous:
            try:
                per_layer = getattr(text_config, name, None) != value
            except RuntimeError as exc:  # transformers' AmbiguousGlobalPerLayerAttributeError
                if raised_by_signal_handler(exc):
                    raise
                per_layer = True
        fields.append(f"{f'per_layer_config[{layer_idx}].' if per_layer else ''}{name}={value!r}")
    if names[1] == "hidden_size":
        fields[1] += f" / num_attention_heads={getattr(config, 'num_attention_heads', None)!r}"
    return ", ".join(fields)


def _refuse_unsupported(model: Any, config: Any, text_config: Any) -> None:
    """Models whose KV is not a function of their token ids alone, or not of one shape."""
    name = type(model).__name__
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        parameters = {}  # type: ignore[assignment]
    inputs = set(parameters)
    # A forward(*args, **kwargs) (a subclass's, a decorator's) names nothing it takes.
    catch_all = "input_ids" not in inputs and any([
        p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) for p in parameters.values()])
    if inputs and not catch_all and isinstance(model, PreTrainedModel) and not inputs & {"cache", "past_key_values"}:
        raise ValueError(f"{name} takes no KV cache (its forward has no cache or past_key_values argument), so "
                         "there is no KV for tierkv to store or restore; use a model that generates with a cache")
    media = sorted(inputs & {"pixel_values", "image_patches", "pixel_values_videos", "input_features", "input_values"})
    for part in ("vision_config", "audio_config", "vision_tower", "speech_config", "vq_config", *media):
        if getattr(config, part, None) is not None or part in media:
            raise ValueError(f"{name} embeds images or audio ({part}); tierkv keys KV on token ids alone, and an "
                             "image's placeholder ids are the same for every image. Use it with a text-only "
                             "language model (AutoModelForCausalLM on the text config)")
    # Layouts of the KV that a reused cache does not give back as recomputed, or that the model
    # builds itself (each found by helper-31 accepted at open, then failing or wrong).
    if getattr(text_config, "ngram", None) and hasattr(text_config, "num_decoder_layers"):
        raise ValueError(f"{name} predicts {text_config.ngram} n-gram streams, whose attention holds a main and "
                         "predicting streams' KV: a prefix restored into it does not equal recomputation (a reused "
                         "DynamicCache fails there too). tierkv supports decoder-only models with one stream")
    loops = getattr(text_config, "n_recurrent_loops", None)
    if isinstance(loops, int) and loops > 1:
        raise ValueError(f"{name} runs its recurrent layers {loops} times, each loop over cache layers it adds "
                         "(copies of the recurrent layers' own) past num_hidden_layers: tierkv cannot restore "
                         "those. Use it without tierkv")
    if callable(getattr(model, "build_delay_pattern_mask", None)):
        # MusicGen's decoders: generate() rewrites the ids it is given into a delay pattern over
        # the codebooks (found by helper-51's sweep: refused at the first forward as ids that are
        # not the conversation's, a message about what the caller fed).
        raise ValueError(f"{name} generates audio codebooks: its generate() rewrites the ids it is given (a "
                         "delay pattern over num_codebooks rows), so the KV it computes is not that of the "
                         "conversation's ids. tierkv supports text decoders; use it without tierkv")
    handed = _cache_handed_by_position(model)
    if handed is not None:
        # Refused here, not at the first forward, where the hook on the inner model finds the
        # cache among its positional arguments (CPM-Ant, found by helper-80's sweep: open
        # accepted it, then generate() raised a message about how the caller passed the cache).
        raise ValueError(f"{handed}, where tierkv cannot check what each forward feeds the cache (ids edited on "
                         f"the way, forwards of other rows); tierkv supports models that pass it by keyword"
                         f"{_WITHOUT_TIERKV}")
    if "langs" in inputs:
        raise ValueError(f"{name} adds language embeddings (langs, which generate() fills in from the config) to "
                         "the ids' KV, which tierkv keys on token ids alone. Use it without tierkv")
    layers = getattr(text_config, "num_hidden_layers", None)
    crossing = [i for i in getattr(text_config, "cross_attention_layers", None) or ()
                if not isinstance(layers, int) or i < layers]
    if crossing:
        raise ValueError(f"{name} has cross-attention layers ({list(crossing)}) that read image states and hold no "
                         "KV of the ids, so a TieredCache would keep nothing of any turn; use a text-only "
                         "model (no cross_attention_layers)")
    # A field may be set per layer (transformers' per_layer_config: dots.llm3's, Gemma 4's), where
    # reading it from the model's config raises: each layer's config is read then.
    for layer_config in (text_config.per_layer_config if getattr(text_config, "is_heterogeneous", False)
                         else (text_config,)):
        v_dim = getattr(layer_config, "v_head_dim", None)
        qk_dim = getattr(layer_config, "qk_head_dim", None) or (
            (getattr(layer_config, "qk_nope_head_dim", 0) or 0) + (getattr(layer_config, "qk_rope_head_dim", 0) or 0))
        rank = getattr(layer_config, "kv_lora_rank", None)
        if rank:
            # What the cache holds is the latent and the rotary keys (transformers' MLA caches them
            # compressed), whatever the heads' dims: a block lays them out apart (layout.py).
            rope = getattr(layer_config, "qk_rope_head_dim", None)
            if not (isinstance(rank, int) and isinstance(rope, int) and rank > 0 and rope > 0):
                raise ValueError(f"{name} uses multi-head latent attention, whose cache holds a compressed latent "
                                 f"of width kv_lora_rank ({rank!r}) as its keys and rotary keys of width "
                                 f"qk_rope_head_dim ({rope!r}) as its values; tierkv needs both to be positive "
                                 f"integers in the config to lay them out{_WITHOUT_TIERKV}")
            continue
        if v_dim and qk_dim and v_dim != qk_dim:
            raise ValueError(f"{name} uses multi-head latent attention (keys of head_dim {qk_dim}, values of "
                             f"{v_dim}); tierkv stores keys and values of one shape, so it does not support it yet"
                             f"{_WITHOUT_TIERKV}")
        head_dim = getattr(layer_config, "head_dim", None) if isinstance(v_dim, int) else None
        if isinstance(head_dim, int) and v_dim != head_dim:
            # MiMo-V2-Flash's full-attention layers: no latent attention, yet values narrower than
            # keys (accepted here, it failed in commit on torch.stack).
            raise ValueError(f"{name} computes keys of head_dim {head_dim} and values of head_dim {v_dim} "
                             "(v_head_dim); tierkv stores keys and values of one shape, so it supports models whose "
                             "values have the keys' head_dim; use a plain DynamicCache for this model")
    # A prefix's KV must not depend on the tokens after it. The attention modules that write the
    # cache (they have a layer_idx; a vision tower's do not) say so with is_causal, or, in BERT-like
    # models whose forward picks a bidirectional mask unless the config is a decoder's (RemBERT,
    # RoFormer, BigBird, Megatron-BERT), with is_decoder; cross-attention reads the encoder's
    # states, not the conversation's.
    for module_name, module in model.named_modules():
        flag = "is_causal" if getattr(module, "is_causal", True) is False else \
            "is_decoder" if getattr(module, "is_decoder", True) is False else None
        writes_cache = hasattr(module, "layer_idx")
        if getattr(module, "attention_type", None) == "block_sparse" and \
                getattr(getattr(module, "config", None), "is_decoder", True) is False:
            # BigBird's block-sparse attention holds no layer_idx and no is_decoder; its first
            # forward swaps in full attention over a bidirectional mask (found by helper-31: a
            # model accepted before any forward served wrong output).
            flag, writes_cache = "config.is_decoder", True
        if flag is not None and writes_cache and \
                not getattr(module, "is_cross_attention", False) and \
                not {"encoder_attn", "crossattention", "cross_attn", "cross_attention"} & set(module_name.split(".")):
            if flag == "is_causal" and getattr(text_config, "is_decoder", False) and \
                    not getattr(text_config, "use_bidirectional_attention", False):
                # BigBirdPegasusForCausalLM: a decoder whose own self-attention says is_causal=False
                # (its eager mask is causal, but a kernel that skips the mask reads the flag).
                # The remedy for BERT-like models, is_decoder=True, is already what it has (the
                # sweep of helper-80 found that advice given to a model built with it).
                raise ValueError(f"{name} is built as a decoder (is_decoder=True), yet {module_name} declares "
                                 "is_causal=False, which attention kernels that skip the mask read as attention in "
                                 "both directions: tierkv cannot tell that a prefix's KV does not depend on the "
                                 f"tokens after it, so it does not serve this model{_WITHOUT_TIERKV}")
            remedy = ("it was built with use_bidirectional_attention=True" if
                      getattr(text_config, "use_bidirectional_attention", False) else
                      "build it with is_decoder=True for a BERT-like model loaded as a causal LM")
            raise ValueError(f"{name} attends in both directions ({module_name} has {flag}=False): a prefix's "
                             f"KV depends on the tokens after it, so stored KV would not equal recomputation "
                             f"({remedy}). tierkv supports causal decoder-only models")


def _cache_handed_by_position(model: torch.nn.Module) -> str | None:
    """Where a forward of ``model`` or of a transformers model inside it calls an inner one
    (``self.<name>(...)``) with enough positional arguments to fill the inner forward's cache
    parameter: that call's cache reaches the inner forward positionally. Read from the source;
    a forward whose source cannot be read, or that passes ``*args``, is not judged here (the
    forward hook still refuses such a call when it happens)."""
    for part in [m for m in model.modules() if isinstance(m, PreTrainedModel)]:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(type(part).forward))))
        except (OSError, TypeError, SyntaxError, IndentationError) as exc:
            if raised_by_signal_handler(exc):
                raise  # a SIGALRM timeout's, as the source was read: the forward went unjudged
            continue
        children = dict(part.named_children())
        for node in list(ast.walk(tree)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and
                    isinstance(node.func.value, ast.Name) and node.func.value.id == "self"):
                continue
            inner = children.get(node.func.attr)
            if not isinstance(inner, PreTrainedModel) or any([isinstance(a, ast.Starred) for a in node.args]):
                continue
            try:
                parameters = list(inspect.signature(inner.forward).parameters.values())
            except (TypeError, ValueError):
                continue
            positional = [p.name for p in parameters
                          if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
            at = ([i for i, n in enumerate(positional) if n in ("cache", "past_key_values")] or [None])[0]
            if at is not None and len(node.args) > at:
                return (f"{type(part).__name__}.forward hands {type(inner).__name__}.forward its cache as positional "
                        f"argument {at + 1} ({positional[at]})")
    return None


def _takes_none(config: Any, field: str) -> bool:
    """Whether ``config`` lets ``field`` be set to None, tried on a copy: Moshi's (huggingface_hub's
    strict validation) takes an int alone, and a refusal told its users to set None (h129)."""
    # A deep copy: a shallow one shares a heterogeneous config's per-layer configs, which a
    # setattr may write through to, editing the live model's config.
    trial = copy.deepcopy(config)
    try:
        setattr(trial, field, None)
    except Exception as exc:
        if raised_by_signal_handler(exc):
            raise  # a SIGALRM timeout's, as the field was tried: not a config that refuses None
        return False
    return True


#: The transformers function that builds each WINDOWED layer type's mask, and the mask's name.
_MASK_MAKERS = {"sliding_attention": ("create_sliding_window_causal_mask", "sliding-window"),
                "chunked_attention": ("create_chunked_causal_mask", "chunked")}


def _builds_masks(model: torch.nn.Module, maker: str) -> bool:
    """Whether the modeling code of a transformers model inside ``model`` calls ``maker`` to build
    its windowed layers' masks (read from its module's source; False where no source can be read). A
    window is kept by two hands in transformers: the mask, which windows every forward, and the
    cache's layer, which drops what lies past the window after each forward; a model whose mask is
    causal alone attends past its window in a forward of many tokens (a prefill), and within it after."""
    for part in [m for m in model.modules() if isinstance(m, PreTrainedModel)]:
        module = sys.modules.get(type(part).__module__)
        if module is None:
            continue
        try:
            source = inspect.getsource(module)
        except (OSError, TypeError) as exc:
            if raised_by_signal_handler(exc):
                raise  # a SIGALRM timeout's, as the source was read: not a module without source
            continue
        if maker in source:
            return True
    return False


def _refuse_hidden_weights(model: torch.nn.Module) -> None:
    """Weights held outside the model's parameters, where the fingerprint cannot read them: torch's
    own quantised modules keep theirs packed in an opaque object. Two such models that differ only
    there (a base model and a fine-tune merged into its linear layers, both quantised) would have
    one fingerprint, and each would be served the other's KV."""
    for name, module in model.named_modules():
        if type(module).__module__.startswith(("torch.ao.nn.quantized", "torch.nn.quantized")) or \
                any([isinstance(value, torch.ScriptObject) for value in vars(module).values()]):
            kind = f"{type(module).__module__}.{type(module).__qualname__}"
            raise ValueError(f"{type(model).__name__}'s {name or 'root'} ({kind}) holds its weights "
                             "outside the model's parameters (torch.ao quantization packs them), where tierkv's "
                             "fingerprint cannot read them: models that differ there would share KV. Use a model "
                             "whose weights are its parameters (unquantized, or quantized by bitsandbytes)")


def _kernels_tag(device: torch.device) -> bytes:
    """Which code computes the KV, beyond the weights: the torch and transformers releases and the
    device kind (for CUDA the GPU's name and compute capability). Another torch picks other kernels
    (oneDNN, cuBLAS), a GPU rounds unlike a CPU and one GPU generation unlike another, and a
    transformers release may change a model's code: KV computed by any of them differs from what
    this one computes, in the last bits or more, so it must not be restored here (a store carried
    across a ``pip install -U``, from the CPU to a GPU or between GPU models restores nothing rather
    than near-misses). On a CPU, which vector code torch and MKL run (``_cpu_tag``): a store
    copied to a machine with other vector units, or read under an ``ATEN_CPU_CAPABILITY`` that
    lowers ATen's level, restores nothing. What a process may switch while it runs is read at
    every open and forward instead: SDPA's kernels, oneDNN, a CPU's threads (``_kernel_switches``)
    and matmul precision (``_matmul_precision``)."""
    import transformers  # the module, for its version; this module already imports transformers

    parts = [f"torch:{torch.__version__}", f"transformers:{transformers.__version__}", f"device:{device.type}"]
    if device.type == "cpu":
        parts.append(_cpu_tag())
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        parts.append(f"gpu:{torch.cuda.get_device_name(index)}:sm_{major}{minor}")
    return "|".join(parts).encode()


# The CPU features that pick vector kernels: ATen's and oneDNN's by instruction set, MKL's also by
# vendor and model. Not the rest of the flags line, which a microcode or kernel update changes
# (mitigations) while the kernels stay the same. Arm's SME (its matrix extension) by Arm's Features
# line alone: x86's flags name AMD's Secure Memory Encryption "sme", which the BIOS turns on or off
# (and a kernel clears when it is off) under the same vector units.
_VECTOR_FLAGS = "avx|amx|fma|f16c|sse|ssse|vnni|bf16|fp16|asimd|sve|i8mm"
_VECTOR_FLAG = re.compile(f"({_VECTOR_FLAGS})")
_ARM_VECTOR_FLAG = re.compile(f"({_VECTOR_FLAGS}|sme)")
# Settings that make MKL or oneDNN run other vector code than the CPU allows. Not torch's
# ATEN_CPU_CAPABILITY, whose effect the tag reads (aten: the dispatch level it leaves): set to the
# level the CPU runs anyway (avx512 on an AVX512 machine, a fleet pinned to avx2 on an AVX2 one),
# or to a value torch ignores, it changed the tag while every kernel stayed the same.
_KERNEL_ENV = ("MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
               "ONEDNN_DEFAULT_FPMATH_MODE")


def _cpu_identity(cpuinfo: str | None) -> list[str]:
    """The CPU's vendor, family and model and its vector features, from ``/proc/cpuinfo``'s first
    processor (x86: ``vendor_id``, ``cpu family``, ``model``, ``flags``; Arm: ``CPU implementer``,
    ``CPU part``, ``Features``); elsewhere what ``platform`` says."""
    import platform

    if not cpuinfo:
        return [f"machine:{platform.machine()}", f"processor:{platform.processor()}"]
    fields: dict[str, str] = {}
    for line in cpuinfo.split("\n\n", 1)[0].splitlines():
        name, sep, value = line.partition(":")
        if sep:
            fields.setdefault(name.strip().lower(), value.strip())
    found = [f"{name}:{fields[name]}" for name in ("vendor_id", "cpu family", "model", "cpu implementer",
                                                    "cpu part", "cpu architecture") if name in fields]
    vector = _VECTOR_FLAG if "flags" in fields else _ARM_VECTOR_FLAG  # x86's flags, Arm's Features
    flags = (fields.get("flags") or fields.get("features") or "").split()
    found.append("features:" + " ".join(sorted(f for f in flags if vector.match(f))))
    return found


@functools.lru_cache(maxsize=1)
def _cpu_tag() -> str:
    """Which vector code computes a CPU model's KV: ATen's dispatch level (``AVX512``, ``AVX2``),
    the CPU (``_cpu_identity``: MKL picks its matmul kernels by vendor and features) and the
    settings that override them (``_KERNEL_ENV``). KV computed with another differs in the last
    bits from the second layer on (ATen's AVX2 kernels against its AVX512 ones, MKL's
    ``MKL_ENABLE_INSTRUCTIONS=AVX2``: 7e-7 to 1e-6 in a 4-layer Llama's keys), so a store copied to
    another machine must not restore it. Read once per process: torch and MKL read their settings
    when they start."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            cpuinfo: str | None = f.read()
    except OSError as exc:
        if raised_by_signal_handler(exc):
            # A SIGALRM timeout's TimeoutError: taken for no /proc/cpuinfo, it set the platform's
            # tag, cached for the process's life, and every store's blocks missed.
            raise
        cpuinfo = None
    parts = [f"aten:{torch.backends.cpu.get_cpu_capability()}", *_cpu_identity(cpuinfo)]
    parts += [f"{name}={os.environ[name]}" for name in _KERNEL_ENV if os.environ.get(name)]
    return "cpu[" + ";".join(parts) + "]"


def _matmul_precision(device: torch.device, dtype: torch.dtype) -> str | None:
    """The settings under which torch computes this model's matmuls at another precision than by
    default, read at every open: float32 matmuls through TF32 or bf16
    (``torch.set_float32_matmul_precision("high")`` or ``("medium")``,
    ``torch.backends.cuda.matmul.allow_tf32``, oneDNN's ``fp32_precision`` on a CPU), and on CUDA
    fp16 and bf16 matmuls without reduced-precision reductions, or fp16 ones accumulating in fp16,
    and on a CPU fp16 matmuls with them.
    KV computed under one differs from what the other computes (fp32 logits 2e-3 apart on a CPU
    at "medium", against 1e-7): a store written by a process that set it and read by one that did
    not (or the reverse) served the other's KV. None at torch's defaults, so that fingerprints
    taken before this was read stay valid for them."""
    parts = []
    backends = torch.backends
    try:
        if dtype == torch.float32 and device.type in ("cpu", "cuda"):
            # The per-backend API (torch 2.9 on): before it torch.backends.mkldnn has no matmul.
            matmul = backends.cuda.matmul if device.type == "cuda" else getattr(backends.mkldnn, "matmul", None)
            precision = getattr(matmul, "fp32_precision", None)
            if precision is None:
                precision = ("tf32" if backends.cuda.matmul.allow_tf32 else "ieee") if device.type == "cuda" else \
                    {"high": "tf32", "medium": "bf16"}.get(torch.get_float32_matmul_precision(), "ieee")
            if precision not in ("none", "ieee"):
                parts.append(f"fp32:{precision}")
        elif dtype == torch.float16 and device.type == "cuda":
            if not backends.cuda.matmul.allow_fp16_reduced_precision_reduction:
                parts.append("fp16-reduction:off")
            if getattr(backends.cuda.matmul, "allow_fp16_accumulation", False):
                parts.append("fp16-accumulation")
        elif dtype == torch.float16 and device.type == "cpu":
            # fp16 matmuls reducing in fp16 on a CPU with fp16 arithmetic (AVX512-FP16, Arm's
            # fp16): torch._C._set_cpu_allow_fp16_reduced_precision_reduction(True); off by default.
            reduced = getattr(torch._C, "_get_cpu_allow_fp16_reduced_precision_reduction", None)
            if reduced is not None and reduced():
                parts.append("fp16-reduction:on")
        elif dtype == torch.bfloat16 and device.type == "cuda":
            if not backends.cuda.matmul.allow_bf16_reduced_precision_reduction:
                parts.append("bf16-reduction:off")
    except RuntimeError:  # torch refuses to say, the legacy and new APIs having both been used
        parts.append("unknown")
    return ",".join(parts) or None


def _not_a_model(model: object) -> str:
    message = f"expected a transformers model (a torch.nn.Module with a .config), got {type(model).__name__}"
    if isinstance(model, (str, os.PathLike)):
        message += f"; load it first: AutoModelForCausalLM.from_pretrained({os.fspath(model)!r})"
    else:
        message += "; pass the model object itself, as AutoModelForCausalLM.from_pretrained(...) returns it"
    return message


def _covered(text_config: Any) -> dict[str, Any]:
    """The config fields the fingerprint's config digest covers."""
    return {k: v for k, v in vars(text_config).items() if k not in _CONFIG_FIELDS_IGNORED}


def _snapshot(fields: dict[str, Any]) -> dict[str, Any]:
    """A copy of config fields that edits in place (a nested rope_parameters) do not reach."""
    try:
        return copy.deepcopy(fields)
    except Exception as exc:  # noqa: BLE001 - a field deepcopy cannot copy: compared by identity then
        if raised_by_signal_handler(exc):
            raise  # a SIGALRM timeout's: a shallow copy missed later edits of nested fields
        return dict(fields)


def _static_facts(model: Any) -> _Static:
    config = getattr(model, "config", None)
    if not isinstance(model, torch.nn.Module) or config is None or not hasattr(config, "to_dict"):
        raise TypeError(_not_a_model(model))
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{type(model).__name__} is an encoder-decoder model; tierkv supports decoder-only "
                         f"models of full-attention or sliding-window layers{_WITHOUT_TIERKV}")
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    if callable(supports) and not supports():
        raise ValueError(f"{type(model).__name__} does not use a standard KV cache (recurrent or custom state); "
                         "tierkv supports decoder-only models of full-attention or sliding-window layers"
                         f"{_WITHOUT_TIERKV}")
    text_config = config.get_text_config(decoder=True)
    _refuse_unsupported(model, config, text_config)
    _refuse_hidden_weights(model)
    layer_types = _layer_types(text_config)
    if not layer_types:
        raise ValueError(f"{type(model).__name__} has no decoder layers (num_hidden_layers=0): it has no KV to "
                         "store; build it with at least one layer")
    # transformers' caches give "dummy" layers to layers that hold no KV: those reading another
    # layer's (KV sharing) and layers without attention (layer_types "mlp", "moe":
    # Nemotron-H's), which are named here as the config names them.
    declared = getattr(text_config, "layer_types", None)
    if isinstance(declared, (list, tuple)) and len(declared) == len(layer_types):
        layer_types = [d if t == "dummy" and d in ("mlp", "moe") else t for t, d in zip(layer_types, declared)]
    # Sliding-window and chunked layers are served (TieredSlidingLayer, WINDOWED).
    # Layers reading an earlier layer's KV ("dummy": Gemma 3n's and Gemma 4's KV sharing) hold none:
    # they take no slot of a block (layout.py), and the layers before them are served.
    other = sorted({t for t in layer_types if t not in ("full_attention", *WINDOWED, "dummy")})
    if other:
        hint = ""
        if {"mlp", "moe"} & set(other):
            hint += (" ('mlp' and 'moe' layers have no attention and hold no KV, so the cache's layers are not "
                     "the model's; tierkv supports models whose every layer holds its own KV)")
        if "indexed_attention" in other:
            hint += (" ('indexed_attention' layers, DeepSeek Sparse Attention's, keep their indexer's keys in the "
                     "cache beside the KV, which tierkv does not store)")
        raise ValueError(f"{type(model).__name__} has {other} layers; tierkv supports decoder-only models with "
                         f"full-attention and sliding-window layers only, for now{hint}{_WITHOUT_TIERKV}")
    for kind, field in WINDOWED.items():
        maker, mask = _MASK_MAKERS[kind]
        if kind in layer_types and not _builds_masks(model, maker):
            remedy = f"Set {field}=None in its config if the checkpoint attends to the whole conversation" \
                if _takes_none(text_config, field) else \
                f"{type(text_config).__name__} takes no {field}=None, so no setting of it has tierkv serve this model"
            raise ValueError(f"{type(model).__name__}'s config names {kind} layers ({field}="
                             f"{getattr(text_config, field, None)!r}), but its modeling code builds no "
                             f"{mask} mask for them (transformers' {maker}; Moshi builds "
                             "a full causal one for its window), or could not be read: transformers' own caches "
                             "then keep its window only from its second forward on, so plain generate's output "
                             f"depends on how a conversation is fed and no restore can equal it. {remedy}"
                             + _WITHOUT_TIERKV)
    # Also the transformers models inside it: a wrapper's generate() may hand off to its inner
    # model's, and its forward call the inner forward directly, without the wrapper's own hooks
    # (peft does both; so does torch.compile's module): the inner hook checks those forwards.
    for part in (model, *(m for m in model.modules() if isinstance(m, PreTrainedModel))):
        if not any([hook is _check_forward for hook in part._forward_pre_hooks.values()]):
            part.register_forward_pre_hook(_check_forward, with_kwargs=True)
    # Their classes' prepare_inputs_for_generation is checked (describe_model installs it).
    prepare_classes = tuple(dict.fromkeys(
        type(part) for part in (model, *(m for m in model.modules() if isinstance(m, PreTrainedModel)))
        if callable(getattr(type(part), _PREPARE, None))))
    sample = WeightSample(model)
    params = sample.params
    if not params:
        raise ValueError("the model has no parameters to fingerprint")
    devices = sorted({str(p.device) for p in params})
    if len(devices) > 1:
        # Layers on several devices write their KV there: one store tier cannot hold a block of them.
        raise ValueError(f"the model's parameters are spread over {devices}; tierkv needs the whole model on one "
                         "device (load it without device_map, or with device_map={'': 'cuda:0'})")
    if devices == ["meta"]:
        # No data to fingerprint, nor to compute KV with: digest_weights would fail on torch's own
        # "cannot copy out of meta tensor".
        raise ValueError("the model's parameters are on the meta device and hold no weights (built under "
                         "torch.device('meta') or accelerate's init_empty_weights, or offloaded); load its weights "
                         "onto one device first (from_pretrained without device_map, or model.to_empty(...) then "
                         "load_state_dict)")
    h = xxhash.xxh3_128()
    h.update(_kernels_tag(params[0].device))
    fields = {k: v for k, v in text_config.to_dict().items() if k not in _CONFIG_FIELDS_IGNORED}
    h.update(json.dumps(fields, sort_keys=True, default=str).encode())
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
    # Compared at every describe (_Static.config_current): a field edited on the live config
    # (X-MOD's set_default_language, clip_qkv set by hand) changes the KV of this model object.
    return _Static(config_digest=h.digest(), num_layers=len(layer_types), sample=sample, windows=_windows(text_config, layer_types),
                   cut_layers=_cut_layers(set(layer_types)), layout=_kv_layout(text_config, layer_types),
                   position_limit=_position_limit(text_config), vocab=_vocab(model), config=config,
                   positions_from_pad=any([hasattr(m, "padding_idx") and hasattr(m, "position_embeddings") and
                                          not isinstance(m, torch.nn.Embedding) for m in model.modules()]),
                   text_config=text_config, config_seen=_snapshot(_covered(text_config)),
                   config_raw=_snapshot(vars(config)), adapters=_adapter_layers(model),
                   experts_configs=_experts_configs(model), prepare_classes=prepare_classes,
                   kv_dtype=_kv_dtype(model))


def _kv_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype the model's layers compute KV in: that of most of the weights of its modules
    that have a ``layer_idx`` (attention modules, decoder layers). Not always the first
    parameter's: a model loaded in bf16 keeps the modules its class lists in
    ``_keep_in_fp32_modules`` in float32 (Ergo's embeddings and norms, first of its parameters),
    and computes its KV in bf16. None when no module has a layer_idx (the first parameter's then)."""
    sizes: dict[torch.dtype, int] = {}
    seen: set[int] = set()
    for module in model.modules():
        if not hasattr(module, "layer_idx"):
            continue
        for p in module.parameters():
            if id(p) not in seen and p.is_floating_point():
                seen.add(id(p))
                sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    return max(sizes, key=sizes.__getitem__) if sizes else None


def _vocab(model: Any) -> int | None:
    """Rows of the model's input embedding (its parameter is sampled: a resize rebuilds the facts)."""
    try:
        weight = model.get_input_embeddings().weight
    except (AttributeError, NotImplementedError):
        return None
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def _attention_of(model: Any) -> str | None:
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return attention if isinstance(attention, str) else None


# torch's own order of SDPA's kernels (flash, memory-efficient, math, cuDNN, overrideable), which
# ``sdpa_kernel(..., set_priority=True)`` replaces. On CUDA, torch reorders them itself at its first
# SDPA call in the process (cuDNN first on sm90 and sm100, the order read after that then: see
# _settle_sdpa_order).
_SDPA_ORDER = [1, 2, 0, 3, 4]
_sdpa_order_settled = False


def _settle_sdpa_order(device: torch.device) -> None:
    """Have torch set SDPA's kernel order on CUDA as it does at its first SDPA call: once per
    process, a priority order still unset (``priority_order_init_`` in sdp_utils.cpp) is replaced
    there by cuDNN's first on Hopper and Blackwell (torch 2.11 on an H200: [1, 2, 0, 3, 4] at open,
    [3, 1, 2, 0, 4] after the prefill), so a cache opened before the process's first forward found
    other kernel switches at its first decode step and raised. ``torch._fused_sdp_choice`` on
    empty tensors runs that setting without running a kernel."""
    global _sdpa_order_settled
    backends = torch.backends.cuda
    if _sdpa_order_settled or device.type != "cuda" or not (backends.flash_sdp_enabled() or backends.math_sdp_enabled()
                                                            or backends.mem_efficient_sdp_enabled()
                                                            or backends.cudnn_sdp_enabled()):
        return  # with every kernel off torch sets no order (and a forward fails): settled at a later read
    try:
        with torch.cuda.device(device), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            q = torch.empty((1, 1, 1, 64), dtype=torch.float16, device=device)
            torch._fused_sdp_choice(q, q, q)
    except Exception as exc:  # all kernels off (sdpa_kernel), or a torch without it: the order as it is
        if raised_by_signal_handler(exc):
            # A SIGALRM timeout's, maybe before torch set its order: settled at the next read.
            # Taken for a refusal, the order read at open was torch's unsettled one, and the
            # first decode step was refused for kernel switches changed.
            raise
    _sdpa_order_settled = True


def _kernel_switches(device: torch.device, attention: str | None) -> str | None:
    """The switches, besides matmul precision (``_matmul_precision``), under which torch computes a
    model's KV with other kernels than by default, where any is set: for a model attending
    through SDPA, which of its kernels a forward may run (some turned off by
    ``torch.nn.attention.sdpa_kernel`` or ``torch.backends.cuda.enable_flash_sdp``, their order
    changed, the math kernel's fp16/bf16 reductions allowed, on CUDA another flash kernel
    activated: ``activate_flash_attention_impl("FA3")``); on a CPU, the intra-op threads of
    the thread that reads it (``torch.set_num_threads``, ``OMP_NUM_THREADS``: oneDNN and MKL split
    a matmul's reduction between them) and oneDNN turned off
    (``torch.backends.mkldnn.flags(enabled=False)``); on CUDA, cuBLASLt preferred to cuBLAS
    (``torch.backends.cuda.preferred_blas_library``). Read at every open and every forward (in
    the forward's thread); on CUDA None at the defaults. Another kernel rounds otherwise: the
    CPU's math SDPA kernel instead of its flash one put a 4-layer Llama's keys 1e-6 apart from
    the second layer on, bf16 matmuls without oneDNN 1e-2; a bf16 Llama (hidden 512) on 2
    threads puts its keys 1e-2 from those on 1, float32 matmuls of 4096 by 4096 1e-4.

    A CPU runs SDPA's flash kernel or its math one, in that order whatever the priority order
    says: the memory-efficient and cuDNN switches and the order change nothing there and are not
    read (``sdpa_kernel([FLASH_ATTENTION, EFFICIENT_ATTENTION, MATH])``, as code written for CUDA
    does, was refused at a forward of a cache opened outside it, and restored nothing inside)."""
    parts = []
    cpu = device.type == "cpu"
    if attention in (None, "sdpa"):
        backends = torch.backends.cuda
        switches = (("flash", backends.flash_sdp_enabled), ("mem_efficient", backends.mem_efficient_sdp_enabled),
                    ("math", backends.math_sdp_enabled), ("cudnn", backends.cudnn_sdp_enabled))
        off = [name for name, enabled in switches if not (cpu and name in ("mem_efficient", "cudnn")) and not enabled()]
        if off:
            parts.append(f"sdpa-off:{'+'.join(off)}")
        order = getattr(torch._C, "_get_sdp_priority_order", None)
        if order is not None and not cpu:
            _settle_sdpa_order(device)
            if list(order()) != _SDPA_ORDER:
                parts.append(f"sdpa-order:{list(order())}")
        reduced = getattr(backends, "fp16_bf16_reduction_math_sdp_allowed", None)
        if reduced is not None and reduced():
            parts.append("sdpa-math-reduced")
        # Another implementation of the flash kernel on CUDA (FA3, FA4: activated through
        # torch.nn.attention.activate_flash_attention_impl, which imports that module first).
        attention_module = sys.modules.get("torch.nn.attention")
        current = getattr(attention_module, "current_flash_attention_impl", None)
        impl = current() if current is not None and not cpu else None
        if impl is not None:
            parts.append(f"sdpa-flash:{impl}")
    if cpu:
        parts.append(f"threads:{torch.get_num_threads()}")
        if not torch.backends.mkldnn.enabled:
            parts.append("onednn:off")
    elif device.type == "cuda":
        blas = torch.backends.cuda.preferred_blas_library()  # TORCH_BLAS_PREFER_CUBLASLT=1, or set in code
        if getattr(blas, "name", str(blas)) != "Cublas":
            parts.append(f"blas:{getattr(blas, 'name', blas)}")
    return ",".join(parts) or None


def _experts_configs(model: torch.nn.Module) -> tuple[Any, ...]:
    """The configs whose ``_experts_implementation`` the model's MoE experts dispatch on:
    transformers' ``use_experts_implementation`` marks each such module (``_is_expert_parallel``)
    and gives it the config it reads at every call."""
    configs: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if hasattr(module, "_is_expert_parallel") and config is not None:
            configs[id(config)] = config
    return tuple(configs.values())


def _experts_of(configs: tuple[Any, ...]) -> str | None:
    """Which implementation the MoE experts run (``set_experts_implementation`` switches it on a
    live model); None for a model without them."""
    if not configs:
        return None
    return ",".join(sorted({str(getattr(c, "_experts_implementation", None)) for c in configs}))


def _decode_kernels(experts: str | None) -> str | None:
    """``_experts_of``'s answer once generate() switched the experts to their decode kernel
    (transformers' ``_optimize_model_for_decode``: every grouped_mm to batched_mm)."""
    if experts is None:
        return None
    return ",".join(sorted({"batched_mm" if name == "grouped_mm" else name for name in experts.split(",")}))


def _adapter_layers(model: torch.nn.Module) -> tuple["weakref.ref[torch.nn.Module]", ...]:
    """peft's adapter layers in ``model``: modules of peft's classes that say which adapters they
    apply. Switching adapters (``set_adapter``, ``disable_adapter()``, a new scale) changes no weight,
    yet every layer's KV. tierkv never imports peft: a model that holds its layers was built with it."""
    if "peft" not in sys.modules:
        return ()
    # Layers declare both as properties; peft's model classes reach disable_adapters through
    # transformers' mixin, a method.
    return tuple(weakref.ref(m) for m in model.modules() if type(m).__module__.startswith("peft.")
                 and isinstance(getattr(type(m), "active_adapters", None), property)
                 and isinstance(getattr(type(m), "disable_adapters", None), property))


def _adapter_state(layers: tuple["weakref.ref[torch.nn.Module]", ...]) -> bytes:
    """A digest of what each adapter layer applies: its active adapters, whether they are disabled
    or merged, their scales (LoRA's ``scaling``) and the adapters peft's own forward hooks pick
    per call (``adapter_names=``); b"" for a model without any."""
    if not layers:
        return b""
    state = []
    for ref in layers:
        layer = ref()
        if layer is None:  # a layer the model no longer holds: the tree check rebuilds the list
            state.append(None)
            continue
        scaling = getattr(layer, "scaling", None)
        hooks = [repr(getattr(hook, "keywords", None)) for hook in layer._forward_pre_hooks.values()
                 if getattr(getattr(hook, "func", hook), "__module__", "").startswith("peft")]
        state.append((list(layer.active_adapters), bool(layer.disable_adapters),
                      list(getattr(layer, "merged_adapters", ())),
                      sorted(scaling.items()) if isinstance(scaling, dict) else None, hooks))
    return xxhash.xxh3_128_digest(repr(state).encode())


# Never traced: a module compiled whole (torch.compile(model)) runs its forward pre-hooks inside
# the compiled frame, where dynamo fails on this hook ("UnspecializedNNModuleVariable(...) is
# already tracked for mutation"); its checks are host-side work due at every call anyway.
@torch.compiler.disable
def _check_forward(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A forward pre-hook on every model ``describe_model`` has seen (kept for the model's life;
    it does nothing unless the call passes a ``TieredCache``): a forward that would feed the cache
    KV not computed from its conversation's ids, or by another model than the one it was opened
    with, is refused before it runs, and the ids fed after the conversation are noted for
    ``commit`` to compare."""
    cache = _cache_of(kwargs)
    if isinstance(cache, TieredCache):
        cache._check_forward(module, kwargs.get("input_ids", args[0] if args else None), kwargs)
    elif any([isinstance(a, TieredCache) for a in args]):
        # Also where a model's own forward hands its inner model the cache by position (CPM-Ant's,
        # which changes the ids on the way): that forward's checks cannot be run.
        raise ValueError(f"a TieredCache reached {type(module).__name__}.forward as a positional argument, where "
                         "tierkv cannot check what it is fed: pass it to the model as past_key_values=cache (or "
                         "cache=cache); a model whose own forward passes it so is not supported (use a plain "
                         "DynamicCache with it)")


def _cache_of(kwargs: dict[str, Any]) -> Any:
    cache = kwargs.get("past_key_values")
    if cache is None:
        cache = kwargs.get("cache")
    if isinstance(cache, EncoderDecoderCache):
        # A decoder built with cross-attention (GPT-2's add_cross_attention) wraps the cache it is
        # given in one, and generate() feeds that wrapper back at every later step.
        cache = cache.self_attention_cache
    return cache


_PREPARE = "prepare_inputs_for_generation"
_MISSING = object()
# The functions _install_checked_prepare installed (of a staticmethod or classmethod: the function
# inside it); by identity, not by a mark a functools.wraps of one would copy onto a patch.
_checked_prepares: "weakref.WeakSet[Any]" = weakref.WeakSet()
_prepare_lock = threading.Lock()


def _check_generate_ids(cache: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The check the wrappers of ``prepare_inputs_for_generation`` run (``_install_checked_prepare``):
    generate() hands that function the whole ids, and feeds the model only those past the cache,
    so the forward hook never sees the ids of the restored prefix. A batch of rows that differ
    there, or ids edited there after ``store.open``, would have the restored KV of another
    conversation: refused here, before the first forward. Nothing unless a TieredCache is given
    (the wrappers call this only for a cache given as one, or wrapped in an EncoderDecoderCache)."""
    if isinstance(cache, EncoderDecoderCache):
        cache = cache.self_attention_cache
    if not isinstance(cache, TieredCache):
        return
    cache._decode_step = kwargs.get("is_first_iteration") is not True  # decode steps do not pass it
    input_ids = args[0] if args else kwargs.get("input_ids")
    fed = kwargs.get("next_sequence_length")
    held = cache.get_seq_length()
    # The forward this prepares feeds ids past the cache, taken from ids that hold it (a decode
    # step, assisted decoding's candidates, a prefill), or ids its prefill found to extend it:
    # not the whole conversation fed again, however its first ids read (see _note_past).
    # Kept as the cache's length then: the forwards at that length (a wrapper's and its inner
    # model's) are the one prepared, and a forward after the cache grew is another.
    extends = cache._prefill_extends or (isinstance(fed, int) and fed > 0 and isinstance(input_ids, torch.Tensor)
                                         and input_ids.dim() == 2 and fed == input_ids.shape[1] - held)
    cache._extends = held if extends else None
    cache._prepared = _UNPREPARED  # the ids it feeds, once prepared (_prepared)
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and fed == input_ids.shape[1] - held:
        # generate() says these ids hold the cached ones (it feeds the model those past them).
        # It does not in a chunked prefill's chunks, nor where it was given only the new ids
        # with a mask over the whole conversation: the forward hook checks those as fed. Its
        # prefill says so (is_first_iteration, which decode steps do not pass): every cached
        # id is compared then, once per generate() call.
        cache._check_prefix(input_ids, whole=kwargs.get("is_first_iteration") is True)


_UNPREPARED: Any = object()


def _prepared(cache: Any, inputs: Any) -> Any:
    """``inputs``, what ``prepare_inputs_for_generation`` returned for ``cache``: the ids it feeds
    past the cache are noted (``TieredCache._prepared``), for the forward hook to tell that
    forward from another at the same length (``_note_past``)."""
    if isinstance(cache, EncoderDecoderCache):
        cache = cache.self_attention_cache
    if isinstance(cache, TieredCache) and cache._extends is not None:
        ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
        cache._prepared = ids if isinstance(ids, torch.Tensor) else None
    return inputs


def _checked_prepare(defined: Any) -> Any:
    """A class attribute that runs ``_check_generate_ids``, then ``defined`` (a function,
    staticmethod or classmethod, as the class defines it) bound as ``defined`` binds; None for
    another kind. Its signature is ``defined``'s (``__wrapped__``: transformers reads the
    parameters), and so are its name and qualified name (transformers' auto classes read them)."""
    if isinstance(defined, staticmethod):
        inner = defined.__func__

        def checked(*args: Any, **kwargs: Any) -> Any:
            cache = kwargs.get("past_key_values")  # _cache_of, inlined: a call less per decode step
            if cache is None:
                cache = kwargs.get("cache")
            if not isinstance(cache, _CHECKED_CACHES):
                return inner(*args, **kwargs)
            _check_generate_ids(cache, args, kwargs)
            return _prepared(cache, inner(*args, **kwargs))
    elif isinstance(defined, (classmethod, types.FunctionType)):
        inner = defined.__func__ if isinstance(defined, classmethod) else defined

        def checked(self: Any, *args: Any, **kwargs: Any) -> Any:  # self: the class for a classmethod
            cache = kwargs.get("past_key_values")
            if cache is None:
                cache = kwargs.get("cache")
            if not isinstance(cache, _CHECKED_CACHES):
                return inner(self, *args, **kwargs)
            _check_generate_ids(cache, args, kwargs)
            return _prepared(cache, inner(self, *args, **kwargs))
    else:
        return None
    try:
        functools.update_wrapper(checked, inner)
    except (AttributeError, TypeError):  # a callable without a name: its signature is enough
        checked.__wrapped__ = inner  # type: ignore[attr-defined]
    if isinstance(defined, staticmethod):
        return staticmethod(checked)
    if isinstance(defined, classmethod):
        return classmethod(checked)
    return checked


def _install_checked_prepare(cls: type) -> None:
    """Keep ``cls.prepare_inputs_for_generation`` checked (``_check_generate_ids``); run at every
    ``describe_model``. A function on a class, not on the model object: it binds to whichever
    instance calls it (a ``copy.copy`` of a model, a pickled one) and holds nothing per model, so
    ``copy``, ``deepcopy`` and pickle never see it. The definition ``cls`` resolves to is
    replaced where it stands, in the class of ``cls``'s MRO that defines it (GenerationMixin for
    most models), by its wrapper; so no class gains an entry that would shadow a base class's,
    and a patch made since, on any class, takes effect at once, as without tierkv: the next
    ``describe_model`` of a model that resolves to it wraps it in turn, so the patch runs under the
    check. A class that resolves to a wrapper already is left as it is (never wrapped twice).
    Every model that resolves to it runs the wrapper, those tierkv never saw too: it does nothing
    unless generate() passes a ``TieredCache``, at about half a microsecond per call on a slow CPU
    (it runs at every decode step; the wrapper on each model object it replaced took 1.3). A ``prepare_inputs_for_generation`` set on a model object shadows it, as
    it shadows any method; a definition that is not a function, staticmethod or classmethod is
    left unchecked."""
    owner, defined = _defined_in(cls)
    if owner is None or _is_checked_prepare(defined):  # one walk of the MRO, without the lock
        return
    with _prepare_lock:
        owner, defined = _defined_in(cls)
        if owner is None or _is_checked_prepare(defined):
            return
        wrapper = _checked_prepare(defined)
        if wrapper is None:
            return
        try:
            setattr(owner, _PREPARE, wrapper)
        except (AttributeError, TypeError):  # a class that takes no attributes: left unchecked
            return
        _checked_prepares.add(getattr(wrapper, "__func__", wrapper))


_PREFILL = "_prefill"
_checked_prefills: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _mask_length(model_kwargs: dict[str, Any], config: Any, model: Any = None) -> int:
    """The length generate()'s prefill reads as the conversation's, as it reads it: its mask's, or,
    where it dropped a mask of ones, the one it noted. Ids as long are the whole conversation (it
    feeds those past the cache); shorter ones are only the new ids (it feeds them all)."""
    encoder_decoder = getattr(getattr(model, "config", None), "is_encoder_decoder", False) is True
    mask = model_kwargs.get("decoder_attention_mask" if encoder_decoder else "attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() >= 2:
        return int(mask.shape[1])
    return int(getattr(config, "_mask_length", -1))


def _check_prefill_length(cache: "TieredCache", given: int, length: int) -> None:
    """Refuse a generate() whose ``given`` ids and mask ``length`` (``_mask_length``) do not fit
    the KV the cache holds at its prefill: the whole conversation (``length == given``) shorter
    than the cache, or only the new ids (``length != given``) under a mask that does not cover the
    cache and them. A mask length transformers does not know (-1) is left to the forward hook."""
    held = cache.get_seq_length()
    if not held or length < 0:
        return
    if length != given and length != held + given:
        # Only the new ids, which generate() feeds all, on top of what the cache holds (less,
        # after a drop of KV it could not vouch for): a chunked prefill then gives them positions
        # from the cache's length, which no check sees to differ from the mask's (helper-41).
        # The ids may be the whole conversation, as the message told to pass them when it spoke of
        # new ids only: the mask was the mistake then, which it did not say (helper-96).
        raise ValueError(f"generate() was given {given} ids with an attention_mask over {length} tokens, while "
                         f"this TieredCache holds {held} now: pass the whole conversation (the sequences the last "
                         "generate() returned, with the new message appended) with a mask over all its ids, or "
                         f"none; or only the new ids with a mask over the cache's tokens and them ({held + given}); "
                         "or commit this cache and open a new one with the conversation")
    if length == given and 0 < given < held:
        # generate() feeds the last ids past that length, at their positions in these ids, on top
        # of another context: one id passed every check (helper-35).
        raise ValueError(f"generate() was given {given} ids, fewer than the {held} this TieredCache holds: it "
                         "takes the whole conversation the cache holds and its new ids (pass the sequences the "
                         "last generate() returned, with the new message appended); for a shorter conversation, "
                         "or after a generate() that raised, commit the cache with the ids you have, which keeps "
                         "the KV up to them, and open a new one")


def _install_checked_prefill(cls: type) -> None:
    """Keep ``cls._prefill`` (transformers' prefill stage of generate, where it defines one)
    checked, as ``_install_checked_prepare`` keeps ``prepare_inputs_for_generation``: a chunked
    prefill (``prefill_chunk_size``) hands that function only the chunks past the cache, never the
    whole ids, so ids edited inside the restored prefix went unchecked, and the output was not
    plain generate's. The prefill stage holds them: checked there, once per generate() call."""
    owner, defined = _defined_in(cls, _PREFILL)
    if owner is None or not isinstance(defined, types.FunctionType) or defined in _checked_prefills:
        return
    with _prepare_lock:
        owner, defined = _defined_in(cls, _PREFILL)
        if owner is None or not isinstance(defined, types.FunctionType) or defined in _checked_prefills:
            return
        inner = defined
        signature = inspect.signature(inner)

        def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
            # generate() passes (input_ids, generation_config, model_kwargs): a look at the second
            # first, as every generate() of every model runs this.
            config = args[1] if len(args) > 1 else kwargs.get("generation_config")
            model_kwargs = args[2] if len(args) > 2 else kwargs.get("model_kwargs")
            extending: TieredCache | None = None
            if isinstance(model_kwargs, dict):
                cache = _cache_of(model_kwargs)
                if isinstance(cache, TieredCache) and getattr(config, "use_cache", None) is False:
                    # Refused before its first forward, which would grow the cache (the forward
                    # hook refuses a later one, and then the cache held the prompt's KV twice over).
                    raise ValueError(_NO_CACHE_USE)
                if isinstance(cache, TieredCache) and (cache.get_seq_length() > cache._restored_held or
                                                       cache._several_rows()):
                    # Chunked or not: generate() reads the length next. (Rows that diverged past
                    # the conversation hold more than it restored.)
                    cache._drop_unverified(model_kwargs.get("attention_mask"))
                given = args[0] if args else kwargs.get("input_ids")
                if isinstance(cache, TieredCache) and isinstance(given, torch.Tensor) and given.dim() == 2:
                    embeds = model_kwargs.get("inputs_embeds")
                    # generate(inputs_embeds=...) hands over no ids: the embeddings stand for the
                    # whole conversation, as ids would (the forward hook then refuses them inside
                    # it, and keeps nothing of them past it), not for only the new ids under a mask.
                    count = (embeds.shape[1] if given.shape[1] == 0 and isinstance(embeds, torch.Tensor)
                             and embeds.dim() == 3 else given.shape[1])
                    length = _mask_length(model_kwargs, config, self)
                    _check_prefill_length(cache, count, length)
                    held = cache.get_seq_length()
                    if count > 0 and (length == count > held or length == held + count != count):
                        # Its forwards feed ids past the cache (those past it in the whole
                        # conversation, or only the new ids): never the conversation fed again.
                        extending = cache
            if extending is not None:
                extending._prefill_extends = True
                try:
                    return run(self, *args, **kwargs)
                finally:
                    extending._prefill_extends = False
            return run(self, *args, **kwargs)

        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            config = args[1] if len(args) > 1 else kwargs.get("generation_config")
            if getattr(config, "prefill_chunk_size", None) is None:
                return inner(self, *args, **kwargs)
            try:
                given = signature.bind(self, *args, **kwargs).arguments
            except TypeError:
                return inner(self, *args, **kwargs)  # transformers' own error
            model_kwargs = given.get("model_kwargs")
            if isinstance(model_kwargs, dict):
                cache = _cache_of(model_kwargs)
                input_ids = given.get("input_ids")
                if isinstance(cache, TieredCache) and isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 \
                        and model_kwargs.get("inputs_embeds") is None \
                        and _mask_length(model_kwargs, config, self) == input_ids.shape[1]:
                    if 0 < input_ids.shape[1] <= cache.get_seq_length():
                        # Its chunks would be every id (input_ids[:, -0:]) on top of the cache: caught
                        # by the forward hook only where the model takes position_ids (not Bloom, MPT).
                        raise ValueError(f"generate() with prefill_chunk_size was given {input_ids.shape[1]} ids "
                                         f"on a TieredCache that holds {cache.get_seq_length()}: it would feed them "
                                         "all again on top of the cache. Pass the whole conversation the cache "
                                         "holds and its new ids, or commit this cache and open a new one with the "
                                         "conversation and its new message")
                    # As without chunks (_check_generate_ids): these ids hold the cached ones.
                    cache._check_prefix(input_ids, whole=given.get("is_first_iteration", True) is True)
            return inner(self, *args, **kwargs)

        functools.update_wrapper(checked, inner)
        try:
            setattr(owner, _PREFILL, checked)
        except (AttributeError, TypeError):
            return
        _checked_prefills.add(checked)


def _defined_in(cls: type, name: str = _PREPARE) -> tuple[type | None, Any]:
    """The class in ``cls``'s MRO that defines ``name`` (``prepare_inputs_for_generation``), and the
    definition in its ``__dict__`` (as ``inspect.getattr_static`` finds it, 20 times faster)."""
    for klass in cls.__mro__:
        found = vars(klass).get(name, _MISSING)
        if found is not _MISSING:
            return klass, found
    return None, None


def _is_checked_prepare(defined: Any) -> bool:
    """Whether ``defined`` (as a class's ``__dict__`` holds it) is a wrapper ``_checked_prepare`` made."""
    return getattr(defined, "__func__", defined) in _checked_prepares  # False for what weakref cannot hold


def describe_model(model: Any, as_opened: ModelInfo | None = None) -> ModelInfo:
    """Validate ``model`` for tierkv and return its fingerprint and shape facts.

    The weight sample is read on every call (``weights.py``: one gather per element size on CPU) with the
    parameters' version counters; when either moved, every weight byte is digested again, so
    in-place writes (``load_state_dict``, training steps, writes under ``no_grad``) change the
    fingerprint at once. A write through ``p.data`` bumps no counter: it is seen only where it
    changes a sampled value. The config digest and validation are computed once per model object,
    and again when a field the digest covers was edited on the live config. With ``as_opened``,
    its matmul precision and kernel switches stand for those read now: ``commit`` takes the
    fingerprint of the settings every forward of the turn was checked under
    (``check_computed_as_opened``), which may since have been set back (the end of a ``with
    sdpa_kernel(...)`` block).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(_not_a_model(model))
    static = _static_cache.get(model)
    held = static.sample.hold() if static is not None else None  # alive until the read below
    # Rebuilt when parameters were replaced (load_state_dict(assign=True), a new lm_head), moved
    # (model.to(...)), cast or given new storage (p.data = ...): the sample points must address
    # the live tensors.
    volatile: list[torch.Tensor] = []  # RoPE's frequency buffers, from the walk current() makes
    while static is None or not static.sample.current(model, (volatile := [])) or not static.config_current(model):
        # Checked again once held: a storage replaced while the sample was built is not held.
        with _describe_lock:  # one thread builds (and hooks) a new model, not each of them
            static = _static_cache.get(model)
            if static is None or not static.sample.current(model) or not static.config_current(model):
                old, static = static, _static_facts(model)
                if old is not None:
                    # Its weights' digest stays valid while their sample and counters do (checked below).
                    static.weights, static.buffers = old.weights, old.buffers
                _static_cache[model] = static
        held = static.sample.hold()
    for cls in static.prepare_classes:  # a definition patched since the last describe is wrapped
        _install_checked_prepare(cls)
        _install_checked_prefill(cls)
    first = static.sample.params[0]  # its dtype and address were just checked by current()
    sampled = static.sample.read()
    counters = versions(static.sample.params)
    weights = static.weights
    if weights is None or weights.sample != sampled or weights.versions != counters:
        with _describe_lock:  # a large model's digest takes seconds: once, not once per thread
            weights = static.weights
            if weights is None or weights.sample != sampled or weights.versions != counters:
                started = time.perf_counter()
                weights = static.weights = _Weights(sampled, counters, digest_weights(static.sample.params))
                seconds = time.perf_counter() - started
                (logger.info if seconds > 1 else logger.debug)(
                    "tierkv: digested %s's weights in %.2f s", type(model).__name__, seconds)
    del held
    h = xxhash.xxh3_128()
    h.update(static.config_digest)
    h.update(str(first.dtype).encode())
    h.update(weights.digest)
    # Read on every call: set_attn_implementation switches it on the same model object. Another
    # attention kernel rounds differently, so from the second layer on its KV differs in the last
    # bits, and a restore would not equal what that model computes. sdpa, the default, adds
    # nothing: fingerprints written before this was read stay valid for it.
    attention = _attention_of(model)
    if attention not in (None, "sdpa"):
        h.update(f"attention:{attention}".encode())
    # Likewise the MoE experts' kernels (batched_mm against eager: KV 1e-5 apart from the second
    # layer on); grouped_mm, the default, adds nothing.
    experts = _experts_of(static.experts_configs)
    if experts not in (None, "grouped_mm"):
        h.update(f"experts:{experts}".encode())
    # Kernels switched off or reordered (sdpa_kernel, enable_flash_sdp, oneDNN off).
    switches = _kernel_switches(first.device, attention) if as_opened is None else as_opened.switches
    if switches is not None:
        h.update(f"switches:{switches}".encode())
    # And the precision torch computes its matmuls at, where it is not the default (TF32, bf16).
    # The layers' dtype: a model keeping its embeddings in float32 computes its KV in bf16 matmuls.
    kv_dtype = static.kv_dtype or first.dtype
    precision = _matmul_precision(first.device, kv_dtype) if as_opened is None else as_opened.precision
    if precision is not None:
        h.update(f"precision:{precision}".encode())
    # RoPE's frequencies (weights.is_frequency_buffer), derived from the config but not saved with
    # the weights. Not where RoPE is recomputed from each forward's length: position_limit keeps
    # those models' KV within the base frequencies, which a forward past it replaces until the
    # next shorter one.
    if volatile and static.position_limit is None:
        h.update(static.buffers.digest(volatile))
    adapters = _adapter_state(static.adapters)
    h.update(adapters)
    return ModelInfo(fingerprint=h.digest(), num_layers=static.num_layers, windows=static.windows,
                     cut_layers=static.cut_layers, layout=static.layout,
                     config_digest=static.config_digest, device=first.device, dtype=first.dtype,
                     kv_dtype=kv_dtype,
                     position_limit=static.position_limit, masked_token=_masked_token(model), adapters=adapters,
                     attention=attention, experts=experts, precision=precision, switches=switches, vocab=static.vocab,
                     positions_from_pad=static.positions_from_pad, weights_state=(id(static.sample), counters))


def _rows_equal(rows: np.ndarray, ids: np.ndarray) -> bool:
    """Every row of a 2-D array equals the int64 ``ids``."""
    if rows.dtype.kind not in "iu":
        # Not cast: fractional positions (RoPE takes them) would be truncated into equal ones.
        return bool((rows == ids).all())
    expected = ids.tobytes()
    return all([row.tobytes() == expected for row in rows.astype(np.int64, copy=False)])


def token_ids_of(input_ids: Any, what: str = "input_ids", vocab: int | None = None) -> np.ndarray:
    """A ``(1, L)`` integer tensor as int64 numpy ids, each below ``vocab`` if given, or a clear error."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"{what} must be a torch.LongTensor of shape (1, L), "
                        + (_held_otherwise(input_ids, what) or f"got {type(input_ids).__name__}; use "
                           "tokenizer(..., return_tensors='pt').input_ids"))
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"{what} must hold integer token ids, got dtype {input_ids.dtype}; pass the tokenizer's "
                        "ids as they are (int64), or convert them with .long() if they are whole numbers")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        # "Once per conversation" is the remedy for a batch only: a row without its batch
        # dimension (tokenizer(text).input_ids made a tensor, out[0]) is one conversation already.
        if input_ids.dim() == 1:
            remedy = f"add the batch dimension: {what}[None] (or {what}.unsqueeze(0))"
        elif input_ids.dim() > 2 and input_ids.shape[:-1].numel() == 1:
            remedy = f"give it as one row: {what}.reshape(1, -1)"
        else:
            remedy = "call store.open once per conversation, with one row of ids each"
        raise ValueError(f"{what} must have shape (1, L), one conversation, got {tuple(input_ids.shape)}; {remedy}")
    if input_ids.shape[1] == 0:
        raise ValueError(f"{what} is empty; pass at least one token")
    if input_ids.device.type == "meta":
        raise ValueError(f"{what} is on the meta device, which holds no values; pass the tokenizer's ids")
    if input_ids.layout != torch.strided:
        raise TypeError(f"{what} is a {input_ids.layout} tensor; pass dense ids ({what}.to_dense())")
    # One copy to the host, as int64 first: a uint64 id past int64's range turns negative there.
    # Always a copy: ids kept as a view of the caller's tensor would follow an edit made to it
    # after open, and commit would compare the edited ids with themselves.
    row = input_ids[0].detach().to("cpu", torch.int64, copy=True)
    # In torch, not numpy: open's first steps run right after a forward has evicted the CPU's
    # caches, and numpy's comparison and reduction code, cold then, took 60-75 us to run.
    low, high = (int(x) for x in torch.aminmax(row))
    if low < 0:
        raise ValueError(f"{what} holds negative token ids; pass the tokenizer's ids")
    if vocab is not None and high >= vocab:
        # Else the embedding's lookup fails inside the forward (a device-side assert on CUDA).
        raise ValueError(f"{what} holds token id {high}, past the model's {vocab} embeddings; pass ids from "
                         "this model's tokenizer (or resize_token_embeddings after adding tokens)")
    return row.numpy()


def _held_otherwise(value: Any, what: str) -> str | None:
    """How ids held outside a tensor, in ``value`` named ``what``, become one ("got ...; convert
    it: ..."), for ``open`` and ``commit`` alike; None for anything else. Such ids are converted,
    not tokenized again: the caller may have no tensor from a tokenizer or generate() to pass (a
    pipeline's generated_token_ids, a chat history kept as a list)."""
    if isinstance(value, Mapping) and "input_ids" in value:
        # A tokenizer's whole output (apply_chat_template returns one by default in
        # transformers 5): its ids are in it, as generate(**inputs) takes them.
        made = "" if isinstance(value["input_ids"], torch.Tensor) else ", made with return_tensors='pt'"
        return (f"got {type(value).__name__}, a tokenizer's output: pass the ids under its 'input_ids' key "
                f"(encoding['input_ids']{made})")
    if isinstance(value, np.ndarray):
        return f"got a numpy array; convert it: torch.from_numpy({what})"
    if isinstance(value, (list, tuple)) and value:
        kind = type(value).__name__
        if all([_is_id(i) for i in value]):
            return f"got a {kind} of token ids; convert it, as one row: torch.tensor([{what}])"
        if all([isinstance(row, (list, tuple)) and row and all([_is_id(i) for i in row]) for row in value]):
            return f"got a {kind} of rows of token ids; convert it: torch.tensor({what})"
    return None


def _is_id(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def sequence_ids_of(sequences: Any) -> np.ndarray:
    """Row 0 of the ids ``generate`` returned, ``(k, L')``: every row starts with the prompt.
    A ``generate`` output object (``return_dict_in_generate=True``) gives its ``.sequences``."""
    if not isinstance(sequences, torch.Tensor) and isinstance(getattr(sequences, "sequences", None), torch.Tensor):
        sequences = sequences.sequences
    if not isinstance(sequences, torch.Tensor):
        raise TypeError("commit() takes the LongTensor that generate() returned, "
                        + (_held_otherwise(sequences, "sequences") or f"got {type(sequences).__name__}"))
    if sequences.dim() != 2 or sequences.shape[0] < 1:
        remedy = ("pass the tensor generate() returned as it is (out, not out[0]), or add the batch dimension "
                  "to a row: row[None]" if sequences.dim() == 1 else "pass the tensor generate() returned")
        raise ValueError(f"commit() takes ids of shape (1, L'), got {tuple(sequences.shape)}; {remedy}")
    return token_ids_of(sequences[:1], "sequences")


#: ``torch.inference_mode``'s own guard (see ``restore_slots``); the public class where a torch
#: lacks it.
_InferenceMode: Any = getattr(torch._C, "_InferenceMode", torch.inference_mode)

#: A restored block that ``store.open`` read from disk straight into the restore's buffer: no
#: tensor of its own (``restore_slots``).
IN_PLACE: Job[Any] = Job.completed(None)

#: A restored block no layer reads, left where it rests (``unread_blocks``): every layer of the
#: model slides, and its window no longer reaches the block.
UNREAD: Job[Any] = Job.completed(None)


def window_cut(sizes: list[int], window: int) -> tuple[int, int]:
    """(blocks, tokens) at the start of a restore of blocks of ``sizes`` tokens that a layer
    attending over its last ``window - 1`` tokens never reads again: whole blocks, so that every
    block a commit may store anew (the one the restore ends in, and those after it) is held."""
    first = skip = 0
    left = sum(sizes)
    for n in sizes:
        if left - n < window - 1:
            break
        first, skip, left = first + 1, skip + n, left - n
    return first, skip


def unread_blocks(windows: tuple[int | None, ...] | None, sizes: list[int]) -> int:
    """The leading blocks of a restore that no layer reads: those every layer's window no longer
    reaches (a model whose layers all slide: Mistral's window), none where a layer attends to
    every token."""
    if not windows or None in windows:
        return 0
    return window_cut(sizes, max(windows))[0]


def layer_skips(windows: tuple[int | None, ...] | None, sizes: list[int]) -> list[int] | None:
    """Tokens at the start of a restore of blocks of ``sizes`` tokens each layer leaves out (a
    sliding layer's ``window_cut``; 0 for a layer attending to every token), or None where no
    layer slides."""
    if not windows or windows.count(None) == len(windows):
        return None
    cuts = {w: window_cut(sizes, w)[1] for w in set(windows) if w is not None}  # a walk per window, not per layer
    return [0 if w is None else cuts[w] for w in windows]


class RestoreBuffer:
    """A restore's blocks read from disk on CPU, laid out as its layers' keys and values will be:
    ``layers[i]`` is layer ``i``'s (2, H, length - skips[i], D) tensor, from the first token its
    window reaches (``skips[i]``, 0 for a full-attention layer) to the conversation's end, room for
    the first forward's tokens included. Consecutive layers of the same skip share one tensor (a
    run), which a block reaches in one copy: a sliding layer's part no window reaches is never
    allocated (one buffer of every layer's whole length held a Gemma 3's disk restore at 3.7 times
    its KV until the first decode step). With a ``layout`` (layers of other KV shapes,
    ``layout.py``), each layer has keys ``(1, H, length - skip, D)`` and values of their own shapes
    (a pair; None for a layer holding no KV), and a block reaches them in one copy per unit."""

    __slots__ = ("layers", "skips", "dtype", "length", "facts", "runs")

    def __init__(self, header: Any, length: int, skips: list[int] | None, layout: KVLayout | None = None) -> None:
        slots, two, heads, _, dim = header.shape
        layers = slots if layout is None else len(layout.layers)
        skips = [0] * layers if skips is None else skips
        if len(skips) != layers:
            raise CorruptRecord(f"a block of {layers} layers restored for a model of {len(skips)}")
        if layout is not None and (slots, heads, dim) != (layout.slots, layout.heads, layout.dim):
            raise CorruptRecord(f"a block shaped {tuple(header.shape)} restored for a model whose blocks hold "
                                f"{layout.slots} slots of {layout.heads} KV heads x head_dim {layout.dim}")
        self.skips, self.length, self.dtype = skips, length, getattr(torch, header.dtype)
        # The shape facts every later block must share.
        self.facts = (header.dtype, slots, two, heads, dim)
        self.layers: list[torch.Tensor] = []
        # (first payload row, uint8 view (rows, tokens, D * itemsize), skip): a run's, or a slot's keys or values.
        self.runs: list[tuple[int, np.ndarray, int]] = []
        if layout is not None:
            self._lay_out(layout, two)
            return
        first = 0
        for i in range(1, layers + 1):
            if i < layers and skips[i] == skips[first]:
                continue
            skip = skips[first]
            # A normal tensor even when ``open`` runs under torch.inference_mode: the first forward
            # writes into it, which torch refuses for an inference tensor outside that mode. Through
            # torch's C guard, whose enter and exit are no Python calls: ``torch.inference_mode``'s
            # are, and another signal's handler raising as its exit started (or as the guard's enter
            # returned inside its enter) left the guard entered: the caller's inference_mode block
            # ran on with the mode off, and once the exception was let go (the guard collected) the
            # mode came back on in the caller's thread for good.
            with _InferenceMode(False):
                kv = torch.empty((i - first, two, heads, length - skip, dim), dtype=self.dtype)
            self.layers.extend(kv.unbind(0))
            # .view, never reshape: a copy would take the reads and leave the buffer unwritten.
            self.runs.append((first * two * heads, kv.view(torch.uint8).view((i - first) * two * heads,
                                                                             length - skip, -1).numpy(), skip))
            first = i

    def _lay_out(self, layout: KVLayout, two: int) -> None:
        """Keys and values per layer, and a run per unit, made in the payload's row order (layers
        in order hold consecutive units, a layer's keys and values interleaved or one after the
        other): the payload's rows of unit ``u`` are ``[u * H0, (u + 1) * H0)``."""
        for i, (layer, skip) in enumerate(zip(layout.layers, self.skips)):
            if layer is None:
                self.layers.append(None)  # type: ignore[arg-type]  # holds no KV: never asked for
                continue
            kh, kd, vh, vd = layout.shape(i)
            with _InferenceMode(False):  # as in __init__
                kv = (torch.empty((1, kh, self.length - skip, kd), dtype=self.dtype),
                      torch.empty((1, vh, self.length - skip, vd), dtype=self.dtype))
            self.layers.append(kv)  # type: ignore[arg-type]
            # Each (h, H0, tokens, d, D0 * itemsize), a view, and the units' rows in its order.
            pieces = []
            for units, tensor in zip((layer.keys, layer.values), kv):
                rows = tensor.view(torch.uint8).view(units.heads, layout.heads, self.length - skip, units.parts,
                                                     -1).numpy()
                if units.step == 1 and layout.heads == 1:
                    # A head's units lie together, a row each (latent attention's keys: 8 units
                    # of a 512-wide latent): one piece of them, (d, tokens, D0 * itemsize), and
                    # two ninths of the pieces a DeepSeek-V3 block's 61 layers made (122 of 549).
                    pieces.append([((units.first + g * units.parts), rows[g, 0].transpose(1, 0, 2))
                                   for g in range(units.heads)])
                    continue
                pieces.append([((units.first + units.step * (g * units.parts + p)) * layout.heads, rows[g, :, :, p])
                               for g in range(units.heads) for p in range(units.parts)])
            keys, values = pieces
            ordered = [piece for pair in zip(keys, values) for piece in pair] if layer.keys.step == 2 \
                else keys + values
            self.runs.extend([(row, view, skip) for row, view in ordered])


def restore_slots(buffer: list[Any], length: int, at: int, n: int, header: Any,
                  skips: list[int] | None = None, layout: KVLayout | None = None) -> list[tuple[int, np.ndarray]]:
    """Where a block read from disk lands in a restore's buffer: tokens ``[at, at + n)`` of each
    layer that holds them, as the ``codec.Pieces`` ``codec.decode_into`` fills. The first call
    makes the ``RestoreBuffer`` (``buffer[0]``) from the block's own shape and dtype, each layer
    from its ``skips`` on (None: every layer whole), in the model's ``layout`` (``layout.py``).
    ``length`` is the whole conversation's, so the buffer has room for the tokens the first
    forward adds. Later blocks slice the numpy views made once: four torch calls a block cost 20
    us each right after a forward."""
    layers, two, heads, _, dim = header.shape
    if not buffer:
        buffer[:] = [RestoreBuffer(header, length, skips, layout)]
    made: RestoreBuffer = buffer[0]
    if made.facts != (header.dtype, layers, two, heads, dim):
        raise CorruptRecord(f"a block shaped {tuple(header.shape)} in {header.dtype} among blocks shaped "
                            f"{made.facts[1:4]} x {made.facts[4]} in {made.facts[0]}")
    # In the payload's row order, as decode_into takes them: the runs are made in that order.
    return [(row, view[:, at - skip:at - skip + n]) for row, view, skip in made.runs if at >= skip]


class _Restore:
    """One restore's blocks, shared by every layer of the cache. Each block that is not a CUDA
    copy is waited for once and split into its per-layer views once (``unbind``, one call), for
    whichever layer comes first: a view per block per layer was a dispatch each, tens of
    microseconds per layer right after the forward's own kernels.

    With a ``buffer`` (blocks read from disk on CPU, ``restore_slots``), layer ``i`` is assembled
    in ``buffer.layers[i]``: the blocks read into it are there already, the others are copied in,
    and room past them is left for the first forward's tokens. ``open`` lays it out for the restore
    it hands over, so each layer's part starts no later than the first token its window reaches."""

    __slots__ = ("blocks", "tokens", "_views", "buffer", "_cuts", "layout")

    def __init__(self, blocks: list[tuple[Job[torch.Tensor], int]], buffer: RestoreBuffer | None = None,
                 layout: KVLayout | None = None) -> None:
        self.blocks = blocks
        self.tokens = sum(n for _, n in blocks)
        self._views: list[tuple[torch.Tensor, ...] | None] = [None] * len(blocks)
        self.buffer = buffer
        self._cuts: dict[int, tuple[int, int]] = {}
        # Layers of other KV shapes (layout.py): a layer's part of a block is several units, and
        # its parts are pairs of (h, H0, n, d, D0) views, keys and values, joined by ``join``.
        self.layout = layout

    def layer_buffer(self, i: int, first: int = 0) -> Any:
        """Layer ``i``'s (2, H, length - skip, D) part of the buffer (with a layout, its keys and
        values, a pair), from the token its window reaches, every restored block from block
        ``first`` on in place (copying again a block copied before is harmless: a retry after an
        interrupted assembly)."""
        assert self.buffer is not None
        kv, base = self.buffer.layers[i], self.buffer.skips[i]
        layout = self.layout
        at = 0
        for j, (job, n) in enumerate(self.blocks):
            if job is not IN_PLACE and j >= first and at >= base:
                views = self._block_views(j)
                if layout is None:
                    kv[:, :, at - base:at - base + n].copy_(views[i])
                else:
                    keys, values = layout.part(views[0], i)
                    layout.split(kv[0][0, :, at - base:at - base + n], i, False, view=True).copy_(keys)
                    layout.split(kv[1][0, :, at - base:at - base + n], i, True, view=True).copy_(values)
            at += n
        return kv

    def fits(self, i: int, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """Whether a forward's new keys and values of one row fill the room layer ``i``'s buffer
        leaves past the restored tokens, in its dtype (a layer holding no KV has none)."""
        assert self.buffer is not None
        room, q = self.buffer.layers[i], key_states.shape[-2]
        if room is None or self.tokens + q != self.buffer.length or key_states.shape[0] != 1:
            return False
        if self.layout is None:
            return key_states.dtype == value_states.dtype == room.dtype \
                and key_states.shape == value_states.shape == (1, room.shape[1], q, room.shape[3])
        keys, values = room
        return key_states.dtype == value_states.dtype == keys.dtype \
            and key_states.shape == (1, keys.shape[1], q, keys.shape[3]) \
            and value_states.shape == (1, values.shape[1], q, values.shape[3])

    def check_held(self, i: int, skip: int) -> int:
        """The first token layer ``i``'s buffer holds, checked to be no later than ``skip``, the
        first its window reaches."""
        assert self.buffer is not None
        base = self.buffer.skips[i]
        if skip < base:
            # open lays the buffer out for the restore it hands over (_plan_again): never met.
            raise RuntimeError(f"layer {i} needs restored tokens from {skip} on, its buffer holds them from {base}")
        return base

    def _block_views(self, j: int) -> tuple[torch.Tensor, ...]:
        """Block ``j`` cut to the tokens restored of it: a view per layer where the layers are of
        one KV shape; else the block itself, alone (``layout.part`` views it per layer)."""
        views = self._views[j]
        if views is None:
            job, n = self.blocks[j]
            tensor = job.wait()
            cut = tensor if n == tensor.shape[3] else tensor[:, :, :, :n]
            views = self._views[j] = cut.unbind(0) if self.layout is None else (cut,)
        return views

    def join(self, i: int, parts: list[Any], new: Any = None) -> Any:
        """Layer ``i``'s parts and its ``new`` (2, H, q, D) keys and values, concatenated along the
        tokens into one (2, H, N, D) tensor; with a layout, ``new`` is a pair of (1, H, q, D) keys
        and values, and so is what it returns (``layout.join``)."""
        layout = self.layout
        if layout is None:
            return torch.cat(parts if new is None else [*parts, new], dim=-2)
        if new is not None:
            parts = [*parts, (layout.split(new[0][0], i, False), layout.split(new[1][0], i, True))]
        return layout.join(parts, i)

    def layer_parts(self, i: int, first: int = 0, skip: int = 0) -> list[torch.Tensor]:
        """Layer ``i``'s keys and values, stacked, as (2, H, n, D) views of each block from block
        ``first`` on (with a layout, ``layout.part``'s views), the ``skip`` tokens of the blocks
        before it left out; ``join`` concatenates them."""
        if self.buffer is not None:
            base = self.check_held(i, skip)
            kv = self.layer_buffer(i, first)
            if self.layout is None:
                return [kv[:, :, skip - base:self.tokens - base]]
            return [(self.layout.split(kv[0][0, :, skip - base:self.tokens - base], i, False, view=True),
                     self.layout.split(kv[1][0, :, skip - base:self.tokens - base], i, True, view=True))]
        # A layered CUDA copy orders this layer's compute after its own copies on the GPU, with no
        # host sync; any other job is waited for.
        seen: set[int] = set()
        layout = self.layout
        stream = None  # looked up once: it costs more than the wait itself
        parts = []
        # The blocks left out are not waited for: no layer's compute reads them (a block's copy
        # in flight keeps its tensors alive on its own stream).
        for j in range(first, len(self.blocks)):
            job, n = self.blocks[j]
            if isinstance(job, _CudaCopyJob):
                if stream is None:
                    stream = torch.cuda.current_stream(job.device)
                if layout is None:
                    tensor = job.stream_wait_layer(i, seen, stream)
                    # A block's keys and values of one layer lie together: a whole block is one view.
                    parts.append(tensor[i] if n == tensor.shape[3] else tensor[i, :, :, :n])
                    continue
                # A layer of several slots waits for its last: a block's slots are copied in order.
                tensor = job.stream_wait_layer(layout.layers[i].last_slot, seen, stream)
                parts.append(layout.part(tensor if n == tensor.shape[3] else tensor[:, :, :, :n], i))
                continue
            # Inline, not a method of its own: a call per block per layer made a restore of 256 blocks
            # of 32 layers take its parts a third slower (1.5 ms, from 1.15; h121), for models of
            # one KV shape too.
            views = self._block_views(j)
            parts.append(views[i] if layout is None else layout.part(views[0], i))
        return parts

    def window_cut(self, window: int) -> tuple[int, int]:
        """``window_cut`` of this restore's blocks, once per window: every sliding layer asks it
        at its assembly and at the commit (a walk of the blocks each)."""
        cut = self._cuts.get(window)
        if cut is None:
            cut = self._cuts[window] = window_cut([n for _, n in self.blocks], window)
        return cut


class TieredLayer(DynamicLayer):
    """One layer of a ``TieredCache``: a ``DynamicLayer`` whose restored prefix arrives as jobs."""

    def __init__(self) -> None:
        self._pending: _Restore | None = None
        self._layer_idx = 0
        # Tokens at the conversation's start whose KV this layer does not hold (a sliding layer's
        # restore, cut to its window): its keys and values start at that token.
        self._offset = 0
        super().__init__()

    # Materialize on any access, so transformers code reading `.keys` directly sees the prefix.
    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        if self._pending is not None:
            self._materialize()
        return self._keys

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._keys = value

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        if self._pending is not None:
            self._materialize()
        return self._values

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._values = value

    def restore(self, layer_idx: int, restore: _Restore) -> None:
        self._layer_idx = layer_idx
        self._pending = restore
        self.is_initialized = True

    def _cut(self, restore: _Restore) -> tuple[int, int]:
        """(blocks, tokens) at the restore's start this layer leaves out: none; a sliding layer's
        are those its window no longer reaches."""
        return 0, 0

    def crop_floor(self) -> int:
        return 0

    def held_from(self) -> int:
        """The first token whose KV this layer holds, or will once its pending restore is
        assembled (the cut a sliding layer's assembly makes is known before it)."""
        return self._offset if self._pending is None else self._cut(self._pending)[1]

    def _take_parts(self) -> tuple[list[torch.Tensor], int]:
        """Wait for the restored blocks; this layer's keys and values, stacked, as (2, H, n, D)
        views of each block it holds, and the tokens before them it leaves out. The blocks stay
        pending until ``_assemble`` succeeds: a wait or a concatenation that raises (out of
        memory, Ctrl-C) leaves the layer as it was."""
        restore = self._pending
        assert restore is not None
        first, skip = self._cut(restore)
        parts = restore.layer_parts(self._layer_idx, first, skip)
        self.device = (parts[0] if restore.layout is None else parts[0][0]).device
        return parts, skip

    def _assemble(self, kv: Any, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Keys and values as the two halves of one (2, H, n, D) tensor (with a layout, a pair of
        # tensors): each is a contiguous (1, H, n, D) tensor, as DynamicLayer's own concatenations
        # make them (but a cut layer's read from disk in place: a view of its buffer from the cut
        # on, until its first decode step).
        # chunk, native: Tensor.split is a Python wrapper, twice the cost here.
        keys, values = kv if type(kv) is tuple else kv.chunk(2)
        self._keys, self._values, self._pending, self._offset = keys, values, None, offset
        return keys, values

    def _materialize(self) -> None:
        restore = self._pending
        parts, skip = self._take_parts()
        assert restore is not None
        self._assemble(restore.join(self._layer_idx, parts), skip)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pending is not None:
            restore = self._pending
            buffer = restore.buffer
            # Not with autograd recording: the layers' keys and values are views of shared buffers,
            # and each layer's write into it is an in-place change of their base that autograd
            # holds against the others (the next step's concatenation of a split's view raises).
            # Whether the keys need grad is not enough: a query that does (an adapter on q_proj
            # alone) has attention save the layer's views, and a later layer's copy of a block
            # from memory into the buffer then fails backward.
            if buffer is not None and not torch.is_grad_enabled() and restore.fits(self._layer_idx, key_states,
                                                                                 value_states):
                # The first forward after a restore read from disk, with the conversation's new
                # tokens: written into the room left for them, no concatenation of the layer (cut
                # to its window as open laid the buffer out: layer_parts checks they agree).
                first, skip = self._cut(restore)
                base = restore.check_held(self._layer_idx, skip)
                kv = restore.layer_buffer(self._layer_idx, first)
                end = restore.tokens - base
                if restore.layout is not None:
                    keys, values = kv
                    keys[0, :, end:].copy_(key_states[0])
                    values[0, :, end:].copy_(value_states[0])
                    self.device = keys.device
                    return self._assemble((keys[:, :, skip - base:], values[:, :, skip - base:]), skip)
                kv[0, :, end:].copy_(key_states[0])
                kv[1, :, end:].copy_(value_states[0])
                self.device = kv.device
                return self._assemble(kv[:, :, skip - base:] if skip != base else kv, skip)
            parts, skip = self._take_parts()
            dtype = (parts[0] if restore.layout is None else parts[0][0]).dtype
            if key_states.dtype != dtype or value_states.dtype != dtype:
                # torch.cat would promote them to one dtype, and the output differ from recomputation.
                raise ValueError(f"the model computed keys in {key_states.dtype} and values in {value_states.dtype}, "
                                 f"but this TieredCache restored them in {dtype}, its weights' dtype at "
                                 "store.open: a model cast since (model.to(dtype)) needs a new store.open; otherwise "
                                 "tierkv needs a model that computes its KV in the dtype of its weights")
            if key_states.shape[0] == 1:
                # The first forward after a restore: one concatenation of the restored blocks and the
                # new tokens, for keys and values together, rather than a copy of the prefix first.
                new = torch.cat((key_states, value_states)) if restore.layout is None else (key_states, value_states)
                return self._assemble(restore.join(self._layer_idx, parts, new), skip)
            self._assemble(restore.join(self._layer_idx, parts), skip)
        if key_states.shape[0] > 1 and self.is_initialized and self._rows() == 1:
            # A restored batch-1 prefix meeting beams or several return sequences.
            self.batch_repeat_interleave(key_states.shape[0])
        # No reference to the old keys is held here: DynamicLayer's concatenations free each old
        # tensor as soon as its successor is made. Kept alive through the values' concatenation,
        # they made every decode step of a 64 MiB cache 5-8% slower (benchmarks.decode).
        return super().update(key_states, value_states, *args, **kwargs)

    def span(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row 0's keys and values of tokens ``[start, end)``, (H, n, D) each: ``block_tensor``'s."""
        # The keys first: their first read assembles a pending restore, which sets the offset
        # (read before, it was 0 for a sliding layer still pending, and the slice missed).
        keys, values = self.keys, self.values
        at = self._offset
        return keys[0, :, start - at:end - at], values[0, :, start - at:end - at]  # type: ignore[index]

    def _rows(self) -> int:
        if self._pending is not None:
            return 1  # a restore is one conversation; reading .keys would assemble it a copy early
        keys = self._keys
        return 0 if keys is None or not keys.numel() else int(keys.shape[0])

    def get_seq_length(self) -> int:
        if self._pending is not None:
            return self._pending.tokens
        return self._offset + super().get_seq_length()

    def extent(self) -> tuple[int, int, int, int]:
        """(tokens, rows) of the keys, then of the values; zeros for none. Another signal's
        handler raising between a layer's keys and values (in a crop, a row selection, a reset)
        leaves them apart, values ahead of keys too, which ``held_tokens`` alone does not show."""
        if self._pending is not None:
            return self._pending.tokens, self._pending.tokens, 1, 1
        if not self.is_initialized:
            return 0, 0, 0, 0
        keys, values, at = self._keys, self._values, self._offset
        k = (at + keys.shape[-2], keys.shape[0]) if keys is not None and keys.dim() >= 2 and keys.numel() else (0, 0)
        v = (at + values.shape[-2], values.shape[0]) if values is not None and values.dim() >= 2 \
            and values.numel() else (0, 0)
        return k[0], v[0], k[1], v[1]

    def held_tokens(self) -> int:
        """Tokens whose keys and values this layer both holds (they differ after a forward that
        raised between its two concatenations)."""
        if self._pending is not None:
            return self._pending.tokens
        if self._keys is None or self._values is None or not self.is_initialized:
            return 0
        # An update that raised on a fresh layer leaves transformers' empty 1-D placeholders.
        if self._keys.dim() < 2 or self._values.dim() < 2:
            return 0
        return self._offset + min(self._keys.shape[-2], self._values.shape[-2])

    def reset(self) -> None:
        # Dropped here, not left to DynamicLayer: before transformers 5.18 it zeroed the tensors
        # in place and kept their length, so a reset cache (and assisted decoding, which resets a
        # restored one) attended over zeros, or raised on a layer still waiting for its blocks.
        # One statement, as the sliding layer's must be (below): cut between two of them (by a
        # test cutting at every line), a layer kept an offset past keys it no longer held, or no
        # keys nor pending restore while still initialized, and its length raised AttributeError (h128).
        self._pending, self._offset, self._keys, self._values, self.is_initialized = None, 0, None, None, False
        super().reset()


class TieredSlidingLayer(TieredLayer):
    """A layer attending over a sliding window of ``sliding_window`` tokens (Mistral's, Gemma's local
    layers, GPT-OSS's...; Llama 4's chunks of that many, ``WINDOWED``): to attention it answers as
    transformers' ``DynamicSlidingWindowLayer`` does (the same mask sizes, and the keys and values
    of the window and the new tokens). It holds the turn's tokens, and of a restored prefix the
    blocks its window reaches (``_offset``: the tokens before them, left out): ``commit`` stores
    every token's KV of every layer, so that a later turn can restore any prefix, whose window is
    its last tokens, and the blocks a commit stores anew start with the one the restore ends in. Cut
    to whole blocks, a restore is held from no later than its last block's start; a crop may not
    leave the layer less than a window past where it holds tokens from (``crop_floor``).

    While it holds one row, it hands its oldest tokens off the device (``_staged``,
    ``staged.py``) once it holds its window and two margins, ``margin`` of them at a time: a reply
    longer than the window waits there for ``commit`` (``span``), and the layer holds at most its
    window, two margins and the new tokens. ``margin`` is the store's block size, or a sixteenth of
    the window where that is more: each hand-off copies the window and a margin into a new room,
    so a decode step copies about 17 tokens at most (257 under a 4096-token window with 16-token
    blocks) and the device holds about 1.125 windows. A crop below what it holds takes them back
    first.

    Its keys and values grow in room kept ahead (``_room``), where a ``DynamicLayer`` concatenates
    its whole history at each step: a decode step then copies its new token alone, as the
    window's own cache does, not the conversation. A view of the room is handed on and kept by
    no one past its forward; a layer whose keys are no longer a view of the room (beams
    reordered, a reset, autograd recording) takes ``DynamicLayer``'s path, and room again at the
    next append without."""

    is_sliding = True

    def __init__(self, sliding_window: int, margin: int = 256) -> None:
        super().__init__()
        self.sliding_window = sliding_window
        self.margin = max(1, margin)
        # Tokens [_staged.start, _offset) of row 0, off the device (see the class's docstring).
        self._staged = StagedTokens()
        self._room: tuple[torch.Tensor, torch.Tensor] | None = None
        # The end of the room's tokens handed out so far: an append below it (after a crop:
        # assisted decoding's, a forward's that raised) makes room again rather than writing over
        # tokens a caller may hold (``cache.layers[i].keys`` read before the crop), which a
        # DynamicLayer's concatenation would leave be. A copy of the conversation a crop, as a
        # DynamicLayer's every step.
        self._handed = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        before = self.get_seq_length()
        appended = self._append(key_states, value_states)
        if appended is None:
            # DynamicLayer's concatenation gives the keys a new base: the room would be held for
            # nothing (a quarter more than the conversation) as long as forwards took this path,
            # every one under autograd recording.
            self._room = None
            appended = super().update(key_states, value_states, *args, **kwargs)
        keys, values = appended
        # DynamicSlidingWindowLayer's: the window's last sliding_window - 1 tokens, then the new.
        visible = min(before, self.sliding_window - 1) + key_states.shape[-2]
        if visible >= keys.shape[-2]:
            return keys, values
        return keys[:, :, -visible:], values[:, :, -visible:]

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The keys and values with the new tokens written into the room after them, or None for
        ``DynamicLayer``'s concatenation: a restore still pending (its first forward has its own
        path), an empty layer, tensors of another batch, dtype, device or head shape (beams
        expanding a restored row; the refusals of a dtype not the store's), keys and values of
        different lengths (a forward that raised between them), or autograd
        recording (an in-place write into a tensor its graph saved)."""
        keys, values = self._keys, self._values
        if self._pending is not None or not self.is_initialized or keys is None or values is None \
                or keys.dim() != 4 or values.dim() != 4 or not keys.numel() or torch.is_grad_enabled():
            return None
        n, q = keys.shape[-2], key_states.shape[-2]
        if values.shape[-2] != n:  # a forward that raised between the two: DynamicLayer's path, as before
            return None
        for new, held in ((key_states, keys), (value_states, values)):
            if new.dim() != 4 or new.shape[:2] != held.shape[:2] or new.shape[3] != held.shape[3] \
                    or new.shape[2] != q or new.dtype != held.dtype or new.device != held.device:
                return None
        room = self._room
        keep = self.sliding_window - 1 + self.margin
        if n >= keep + self.margin and keys.shape[0] == 1:
            # At the window and two margins: the oldest tokens go off the device, the rest to a
            # room for a margin more, so that the next cut comes before the room is full. At, not
            # past: a decode step then hands off a margin of tokens, not one more, which CUDA's
            # pinned memory, rounded up to a power of two, held in twice the bytes (257 tokens of
            # a block size of 256 in 512 tokens' room).
            cut = n - keep
            self._staged.add(self._offset, keys[:, :, :cut], values[:, :, :cut])
            size = keep + q + self.margin
            room = (keys.new_empty((*keys.shape[:2], size, keys.shape[3])),
                    values.new_empty((*values.shape[:2], size, values.shape[3])))
            room[0][:, :, :keep].copy_(keys[:, :, cut:])
            room[1][:, :, :keep].copy_(values[:, :, cut:])
            self._keys, self._values, self._offset, self._room, self._handed = \
                room[0][:, :, :keep], room[1][:, :, :keep], self._offset + cut, room, 0
            n = keep
        elif room is None or not (_is_head_of(keys, room[0]) and _is_head_of(values, room[1])) \
                or n + q > room[0].shape[-2] or (room[0].is_inference() and not torch.is_inference_mode_enabled()) \
                or n < self._handed:
            # Past the room (or none): room for a quarter more, at least 256 tokens, copied once;
            # for one row, no more than the next cut leaves room for.
            size = n + q + max(256, (n + q) // 4)
            if keys.shape[0] == 1:
                size = min(size, keep + self.margin + q)
            room = (keys.new_empty((*keys.shape[:2], size, keys.shape[3])),
                    values.new_empty((*values.shape[:2], size, values.shape[3])))
            room[0][:, :, :n].copy_(keys)
            room[1][:, :, :n].copy_(values)
            self._room, self._handed = room, 0
        room[0][:, :, n:n + q].copy_(key_states)
        room[1][:, :, n:n + q].copy_(value_states)
        self._keys, self._values = room[0][:, :, :n + q], room[1][:, :, :n + q]
        self._handed = max(self._handed, n + q)
        return self._keys, self._values

    def _cut(self, restore: _Restore) -> tuple[int, int]:
        return restore.window_cut(self.sliding_window)

    def held_from(self) -> int:
        if self._pending is None and self._staged:
            return self._staged.start
        return super().held_from()

    def crop_floor(self) -> int:
        """The shortest length a crop can leave: one whose window this layer still holds (on the
        device, or handed off it: ``_unstage``)."""
        offset = self.held_from()
        return offset + self.sliding_window - 1 if offset else 0

    def crop(self, tokens_to_remove: int) -> None:
        length = self.get_seq_length() + tokens_to_remove
        if tokens_to_remove < 0 and length <= 0:
            self.reset()  # cut to nothing: as a fresh layer
            return
        if tokens_to_remove < 0 and length < self.crop_floor():
            raise _crop_refusal(self.crop_floor(), length)
        if tokens_to_remove < 0 and self._staged and length < self._offset + self.sliding_window - 1:
            self._unstage()
        super().crop(tokens_to_remove)

    def _unstage(self) -> None:
        """The tokens handed off the device taken back in front of the ones it holds: a crop into
        them (a generate() dropping KV it cannot vouch for, the program's own crop). Assisted
        decoding's crops of rejected candidates never reach them: the layer held a window and a
        margin before the candidates were fed."""
        keys, values = self._keys, self._values
        assert keys is not None and values is not None
        staged_keys, staged_values = self._staged.span(self._staged.start, self._offset, keys.device)
        rows = keys.shape[0]
        if rows != 1:
            # Beams expanded from the one row they were handed off from.
            staged_keys = staged_keys.expand(rows, -1, -1, -1)
            staged_values = staged_values.expand(rows, -1, -1, -1)
        joined = torch.cat((staged_keys, keys), dim=-2), torch.cat((staged_values, values), dim=-2)
        # One statement, the staged tokens' holder too: a handler's exception between this and a
        # clear() left them held twice, off the device and in front of the keys.
        self._keys, self._values, self._offset, self._room, self._staged = \
            joined[0], joined[1], self._staged.start, None, StagedTokens()

    def span(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pending is not None or start >= self._offset or not self._staged:
            return super().span(start, end)
        keys, values = self._staged.span(start, min(end, self._offset), self._keys.device)  # type: ignore[union-attr]
        if end <= self._offset:
            return keys[0], values[0]
        live = super().span(self._offset, end)
        return torch.cat((keys[0], live[0]), dim=-2), torch.cat((values[0], live[1]), dim=-2)

    def with_staged(self) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        """The keys and values from the first token held, those handed off the device brought
        back onto it, and that token (``TieredCache.__iter__``)."""
        keys, values = self.keys, self.values
        if not self._staged or keys is None or values is None or keys.dim() != 4:
            return keys, values, self._offset
        staged_keys, staged_values = self._staged.span(self._staged.start, self._offset, keys.device)
        rows = keys.shape[0]
        return (torch.cat((staged_keys.expand(rows, -1, -1, -1), keys), dim=-2),
                torch.cat((staged_values.expand(rows, -1, -1, -1), values), dim=-2), self._staged.start)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        held = self.get_seq_length()
        return min(held, self.sliding_window - 1) + query_length, max(held - self.sliding_window + 1, 0)

    def get_max_length(self) -> int:
        return self.sliding_window

    def reset(self) -> None:
        # In the base's one statement: cut by another signal's handler after the tokens off the
        # device were let go of and before the base's reset (as ``super()`` returned), the layer
        # kept its offset past them, holding them nowhere, and a turn going on from there was
        # exact but its commit ended the chain at them (48 of 83 tokens kept; h128).
        self._pending, self._offset, self._keys, self._values, self.is_initialized, self._room, self._staged = \
            None, 0, None, None, False, None, StagedTokens()
        super().reset()


class _SharedLayer(DummyLayer):
    """A layer reading an earlier layer's KV (KV sharing: ``num_kv_shared_layers``), as transformers'
    caches hold it: it holds none, and KV fed for it is refused with what to do (transformers' own
    says only that a dummy layer cannot be updated)."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self._layer_idx = layer_idx

    def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> Any:
        if key_states is None and value_states is None:
            return super().update(key_states, value_states, *args, **kwargs)  # a DynamicCache rebuilt from it
        raise ValueError(f"the model fed KV for layer {self._layer_idx}, which its config says reads an earlier "
                         "layer's (num_kv_shared_layers) and holds none: tierkv cannot tell which layers hold KV in "
                         "this model; report the architecture to tierkv's tracker and use a plain DynamicCache "
                         "meanwhile")


def _count(tokens: Any) -> int | None:
    """A crop's count as an int, for the cache's check before any layer is cut; None for what is
    no integer. Each layer's own check compares it as well, but one layer at a time, and a
    ``DynamicLayer`` slices by any count Python can index with: numpy's integers, a 0-d numpy
    array and an integer tensor of one element (of any shape) among them."""
    if isinstance(tokens, (int, np.integer)) and not isinstance(tokens, bool):
        return int(tokens)
    if isinstance(tokens, torch.Tensor) and tokens.numel() == 1 and not tokens.is_floating_point() \
            and not tokens.is_complex() and tokens.dtype != torch.bool:
        return int(tokens)
    if isinstance(tokens, np.ndarray) and tokens.ndim == 0 and np.issubdtype(tokens.dtype, np.integer):
        return int(tokens)
    return None


def _crop_refusal(floor: int, length: int, layers: str = "sliding-window") -> ValueError:
    """``layers``: what the cut layers are, as their config names them (Llama 4's: chunked attention)."""
    return ValueError(f"a crop of this TieredCache to {length} tokens: its {layers} layers hold the "
                      f"restored conversation from where their window reaches, and no crop below {floor} "
                      "tokens (but one to nothing) leaves them a window; call cache.reset() and run the "
                      "conversation again instead (or store.open() it anew)")


def _cut_layers(kinds: set[str]) -> str:
    """The windowed layer kinds among ``kinds``, as a crop's refusal names them."""
    names = [name for kind, name in (("sliding_attention", "sliding-window"),
                                     ("chunked_attention", "chunked-attention")) if kind in kinds]
    return " and ".join(names) or "sliding-window"


def _is_head_of(tensor: torch.Tensor, room: torch.Tensor) -> bool:
    """``tensor`` is ``room``'s first tokens, a view (what a crop or an append left)."""
    return tensor.data_ptr() == room.data_ptr() and tensor.stride() == room.stride() \
        and tensor.shape[:2] == room.shape[:2] and tensor.shape[3] == room.shape[3]


# The forward arguments besides the ids that ``_check_inputs`` reads.
_CHECKED_KWARGS = ("attention_mask", "position_ids", "inputs_embeds", "token_type_ids")
# The tensor inputs of a forward whose effect on the KV the hook checks (ids, mask, positions),
# or that have none. Any other tensor is an input besides the ids that changes their KV and that
# blocks are not keyed on: token types, RoCBert's shape and pronunciation ids, Ernie's task types,
# a decoder's encoder_hidden_states for cross-attention (TrOCR, Bart's decoder), a head_mask.
_KEYED_INPUTS = frozenset({"input_ids", "attention_mask", "position_ids", "inputs_embeds", "cache_position",
                           "labels", "past_key_values", "cache"})


def _unkeyed_input(kwargs: dict[str, Any]) -> str | None:
    """The name of a forward's tensor input that changes its KV besides the ids, or None."""
    for name, value in kwargs.items():
        if value is not None and name not in _KEYED_INPUTS and isinstance(value, torch.Tensor):
            return name
    return None


class _Fed(NamedTuple):
    """A forward past the conversation, as ``commit`` reads it: where it started; its ids (row
    0, copied: a caller's decode loop may reuse or edit the tensor), None where it was fed
    embeddings or token types; and, left on the device until ``commit`` (no sync per decode
    step), whether its 2-D mask hid nothing and the ``position_ids`` it was given."""

    at: int
    ids: torch.Tensor | None
    unmasked: torch.Tensor | None = None
    positions: torch.Tensor | None = None


def _restored_hidden(token: int) -> ValueError:
    return ValueError(f"the attention_mask hides token {token}, which this cache restored from KV computed without "
                      "that mask (generate() masks pad_token_id wherever it appears in the ids). Pass the same "
                      "attention_mask every turn (or none), pass pad_token_id=<your eos id> to generate(), or do "
                      "not pad one conversation")


_NO_CACHE_USE = ("generate() ran with use_cache=False (given to it, or the model's generation_config.use_cache, "
                 "False in some configs such as MPT's), so it feeds every id at every step: a TieredCache would "
                 "hold their KV twice. Pass use_cache=True to generate(), or set "
                 "model.generation_config.use_cache = True")

# Transformers' docs reuse a prompt's cache by deep-copying it; a TieredCache is one turn of one
# conversation, tied to its store (which shares prefixes itself), and a copy would commit twice.
_NO_COPIES = ("a TieredCache cannot be copied or pickled: it is one turn of one conversation, tied to its store. "
              "To reuse a prompt's KV, commit it and store.open a new cache for each turn: the store restores "
              "the shared prefix")


class TieredCache(Cache):
    """A ``transformers.Cache`` backed by a ``TieredStore``; build it with ``store.open``.

    ``restored_tokens``: tokens whose KV ``open`` restored (at most ``L - 1``); ``restored_from``:
    those tokens per tier, ``{"device": n1, "host": n2, "disk": n3}``. Both drop to 0 when the
    restore is thrown away (``reset()``, as assisted decoding does: ``stats()["discarded"]``).
    ``diverged_at``: where the ids first differ from the conversation the session committed last
    (an edit, or a chat template rendering past turns anew), or None (see ``TieredStore.open``).
    Pass the cache to ``model.generate(input_ids, cache=cache)`` (or ``past_key_values=``) with the
    whole conversation, then ``commit`` what ``generate`` returned.
    """

    def __init__(self, *, store: "TieredStore", info: ModelInfo, input_ids: np.ndarray, root: bytes,
                 session: str | None, tenant: str | None,
                 blocks: list[tuple[Job[torch.Tensor], int]], restored_from: dict[str, int],
                 model: torch.nn.Module | None = None, buffer: RestoreBuffer | None = None) -> None:
        windows = info.windows or (None,) * info.num_layers
        layout = info.layout
        layers: list[Any] = [_SharedLayer(i) if layout is not None and not layout.holds(i) else
                             TieredLayer() if w is None else TieredSlidingLayer(w, max(store.block_size, w // 16))
                             for i, w in enumerate(windows)]
        super().__init__(layers=layers)
        # The layers holding KV: those reading an earlier layer's (KV sharing) are transformers'
        # DummyLayer, which holds none, as in its own caches.
        self._kv: list[TieredLayer] = [layer for layer in layers if isinstance(layer, TieredLayer)]
        self._store = store
        self.model_info = info
        # Weak: a cache kept after its turn must not keep a model alive. Other model objects a
        # forward ran on, found to compute the same KV (see _check_model).
        self._model = weakref.ref(model) if model is not None else None
        self._also_fine: list[weakref.ref[torch.nn.Module]] = []
        self._last_checked: tuple[int, tuple[Any, ...]] | None = None  # see _check_forward
        self._hooked = False  # the hook checked the forward now running (see update)
        # generate() is about to run a forward after its prefill (_check_generate_ids): one where
        # it may switch MoE experts to their decode kernel (check_computed_as_opened).
        self._decode_step = False
        # The cache's length when generate() prepared a forward of ids past it (_check_generate_ids),
        # and whether its prefill is of ids found to extend the cache (_install_checked_prefill).
        self._extends: int | None = None
        self._prefill_extends = False
        # The ids that forward feeds (None: not known; _UNPREPARED: its prepare raised), for telling
        # it from another forward at the same length: one after a generate() that raised between
        # its prepare and its forward.
        self._prepared: Any = _UNPREPARED
        self.input_ids = input_ids
        self.root = root
        self.session = session
        self.tenant = tenant
        self.restored_from = dict(restored_from)
        self.restored_tokens = sum(restored_from.values())
        # Where the ids first differ from the conversation the session committed last (set by open).
        self.diverged_at: int | None = None
        self._sid: bytes | None = None  # the session's key in the store (set by open)
        self._restored_held = self.restored_tokens  # restored KV still held: a crop below it gives it back
        # The keys of the blocks restored, block j from token j * block_size (set by open).
        self._restored_keys: list[bytes] = []
        # The first token whose KV commit must not keep: one a forward's attention_mask hid, or the
        # first that generate() computed with MoE experts on their decode kernel.
        self._masked_from: int | None = None
        self._fed: list[_Fed] = []  # the forwards past the conversation
        # The most the cache held before a generate() dropped KV it could not vouch for
        # (_drop_unverified): ids up to it are the caller's, which commit takes.
        self._dropped_from: int | None = None
        # A forward past the conversation fed several rows (beams, samples): the rows' KV there no
        # longer follows row 0's ids once they are reordered or selected, so none is kept.
        self._rows_diverged = False
        # The KV heads and head_dim of keys and values, from the first layer computed (_check_kv_shape).
        self._kv_shape: tuple[int, int, int, int] | None = None
        if blocks:
            restore = _Restore(blocks, buffer, info.layout)
            for i, layer in enumerate(layers):
                if isinstance(layer, TieredLayer):
                    layer.restore(i, restore)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Each layer's keys and values, and its sliding window (a tensor) or None, as
        ``DynamicCache`` yields them: ``DynamicCache(cache)`` copies them out, e.g. to hand a
        turn's KV to code of its own (its sliding layers then keep their window alone)."""
        for layer in self.layers:
            if not isinstance(layer, TieredLayer):
                yield None, None, None  # a layer reading another's KV: DynamicCache(cache, config=...) keeps it so
                continue
            window = getattr(layer, "sliding_window", None)
            keys, values, offset = layer.with_staged() if isinstance(layer, TieredSlidingLayer) else \
                (layer.keys, layer.values, layer._offset)
            if offset and keys is not None and values is not None:
                # A sliding layer cut to its window: its length is the conversation's, so that a
                # DynamicCache made of it counts its tokens right (and keeps the window alone).
                # NaN where it holds nothing, rather than numbers that look like KV.
                keys, values = (torch.cat([t.new_full((*t.shape[:2], offset, t.shape[3]), float("nan")), t],
                                          dim=-2) for t in (keys, values))
            yield keys, values, None if window is None else torch.tensor(window, dtype=torch.long)

    def __repr__(self) -> str:
        return (f"TieredCache(session={self.session!r}, tenant={self.tenant!r}, tokens={self.get_seq_length()}, "
                f"restored_from={self.restored_from})")

    def __deepcopy__(self, memo: dict[int, Any]) -> "TieredCache":
        raise TypeError(_NO_COPIES)

    def __copy__(self) -> "TieredCache":
        raise TypeError(_NO_COPIES)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(_NO_COPIES)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx == 0:
            if not self._hooked:
                # No hook ran for this forward: a model store.open never saw. Its KV would meet
                # the restored blocks of another model, and the output would silently differ.
                raise ValueError(
                    "this TieredCache is being fed by a model tierkv never checked (one never passed to "
                    "store.open, such as a copy made before its first open): open the cache with the model "
                    "that runs it, store.open(that_model, input_ids)")
            self._hooked = False  # one forward's check lets one forward through
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"the model fed KV for layer {layer_idx}, but its config declares {len(self.layers)} "
                             "layers, the number this TieredCache was built with: tierkv cannot tell how many "
                             "layers hold KV in this model; report the architecture to tierkv's tracker and use a "
                             "plain DynamicCache meanwhile")
        # A layer reading another's KV (_SharedLayer) is initialized: its own update refuses KV.
        if not self.layers[layer_idx].is_initialized:
            self._check_kv_shape(layer_idx, key_states, value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _check_kv_shape(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """A layer's first keys and values have the KV heads and head_dim a block holds of it:
        every other layer's, keys as values (or those its config sets for it: ``layout.py``). A
        model whose layers differ there (KV heads per layer, as DeciLM's or OpenELM's remote code)
        or whose values have another head_dim than its keys otherwise got through generate(), then
        failed inside commit on torch.stack, with no word of what to do."""
        shape = (key_states.shape[1], key_states.shape[-1], value_states.shape[1], value_states.shape[-1])
        layout = self.model_info.layout
        expected = self._kv_shape if layout is None else layout.shape(layer_idx)
        if shape == expected or (expected is None and shape[:2] == shape[2:]):
            self._kv_shape = shape if layout is None else None
            return
        found = (f"keys of {shape[0]} KV heads x head_dim {shape[1]} and values of {shape[2]} x {shape[3]} in "
                 f"layer {layer_idx}")
        if layout is not None:
            model = self._model() if self._model is not None else None
            config = getattr(model, "config", None)
            # Named from the model this cache runs (the config as the forward finds it), where
            # "per_layer_config, kv_lora_rank..." named fields of other models than this one.
            fields = _kv_shape_fields(config.get_text_config(decoder=True), layer_idx) if config is not None \
                else "per_layer_config, kv_lora_rank or qk_rope_head_dim"
            raise ValueError(f"the model computes {found}, where its config sets keys of {expected[0]} x {expected[1]} "
                             f"and values of {expected[2]} x {expected[3]} ({fields}): tierkv "
                             "lays each layer's keys and values out in a block from the config, so it cannot store "
                             "this model's; use a plain DynamicCache for this model")
        if expected is not None:
            found += f", and keys and values of {expected[0]} x {expected[1]} in an earlier layer"
        raise ValueError(f"the model computes {found}: tierkv stores every layer's keys and values as one "
                         "tensor, so it supports models whose layers all hold keys and values of one shape "
                         "(the same KV heads and head_dim throughout, or as the config sets them per layer); "
                         "use a plain DynamicCache for this model")

    def commit(self, sequences: torch.Tensor) -> int:
        """Hand this cache's KV for ``sequences`` (the ids ``generate`` returned) to the store.

        The cache holds ``L' - 1`` (or ``L'``) of the ``L'`` ids. Returns the number of tokens whose
        KV the store now has for this conversation: 0 when a ``forget`` of the cache's session or
        tenant ran since its ``open`` (the turn would write the forgotten conversation back). KV the
        cache cannot vouch for (under a mask that hid a token, fed as embeddings, in several rows
        past the conversation) is not kept. Raises ``ValueError`` for ids that do not start with the
        opened conversation or differ from what ``generate`` produced, for a model whose weights,
        dtype or device changed since ``open``, and on a closed store. May be called again with
        the same or longer ids (blocks already stored are not written twice).
        """
        return self._store._commit(self, sequences)

    def _check_forward(self, module: torch.nn.Module, input_ids: Any, kwargs: dict[str, Any]) -> None:
        """The hook's checks, once per forward: an inner model's hook runs them again inside its
        wrapper's forward, on the same inputs (a decode step's cost twice over). Skipped there when
        the inputs are the very objects just checked, at the same length: only the model is
        checked then (``_check_model``, at once for a model already found fine)."""
        if module.training:
            # Dropout makes KV differ from run to run: what commit kept would not be the KV the
            # ids and weights give, and every later turn would restore it.
            raise ValueError(f"the {type(module).__name__} is in training mode (from_config() and train() leave it "
                             "so): dropout would make the KV this TieredCache stores random. Call model.eval() "
                             "before generating with it")
        if torch.is_autocast_enabled(self.model_info.device.type):
            # Under autocast keys and values come out in different dtypes (RoPE promotes the keys),
            # neither the model's: KV restored into it, or kept from it, would not equal recomputation.
            raise ValueError(f"a TieredCache cannot run under torch.autocast: its blocks hold the model's own "
                             f"{self.model_info.kv_dtype} KV. Cast the model to the dtype it should compute in "
                             "(model.to(torch.bfloat16)) and run it without autocast")
        done = self.get_seq_length()
        seen = (input_ids, *(kwargs.get(name) for name in _CHECKED_KWARGS))
        last = self._last_checked
        if last is not None and last[0] == done and all([a is b for a, b in zip(last[1], seen)]):
            # The inner model's hook on its first forward: its wrapper's hook checked these very
            # inputs a moment ago; only whether it computes the opened model's KV is new.
            self._check_model(module)
            self._hooked = True
            return
        # The adapters on the first forward and on every forward of several ids (a prefill: another
        # generate on this cache); the attention implementation, one read, on every forward.
        prefill = last is None or (isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2
                                   and input_ids.shape[1] > 1)
        decode, self._decode_step = self._decode_step, False  # one prepare, one forward
        self.check_computed_as_opened(adapters=prefill, decode=decode)
        self._check_model(module)
        self._check_inputs(input_ids, kwargs, done, self._extends == done)
        self._last_checked = (done, seen)
        self._hooked = True

    def check_computed_as_opened(self, *, adapters: bool = True, weights: bool = False, decode: bool = False) -> None:
        """The opened model still computes KV as it did at ``open``: the same attention
        implementation and (with ``adapters``) the same peft adapters, which the fingerprint covers
        and which change on the same model object. KV restored for one adapter, or computed with
        another and kept under the opened one's fingerprint, would be wrong. Run by the hook (see
        ``_check_forward``) and by ``commit``, which (``weights``) also takes the whole fingerprint
        again: weights loaded, cast or moved during the turn (a weight sync) computed KV that the
        opened fingerprint does not describe. A change undone before ``commit`` is not seen. By the
        hook alone, as every forward computes KV under them: torch's matmul precision and kernel
        switches, which ``commit`` takes as they were at ``open``."""
        opened = self._model() if self._model is not None else None
        if opened is None:
            return
        if _attention_of(opened) != self.model_info.attention:
            raise ValueError(f"the model's attention implementation changed since store.open (from "
                             f"{self.model_info.attention!r} to {_attention_of(opened)!r}): its KV differs in the last "
                             "bits, and this TieredCache holds the other's. Set it first, then open the cache: "
                             "cache = store.open(model, input_ids)")
        # At every forward, where the KV is computed; not at commit, which computes nothing and
        # may come after the `with sdpa_kernel(...)` block the turn ran in.
        if not weights:
            self._check_kernels()
        static = _static_cache.get(opened)
        if adapters and not weights and static is not None and \
                (static.config_digest != self.model_info.config_digest or not static.config_current(opened)):
            # Refused at the forward, not left to commit's whole fingerprint: a field edited on the
            # live config since open (a sliding_window the masks read at every forward while the
            # cache's layers keep the one of open; clip_qkv, X-MOD's language) has this forward
            # compute other KV than the restored prefix's, and other tokens than plain generate's.
            raise ValueError(f"the {type(opened).__name__}'s config changed since store.open (a field its KV depends "
                             "on, such as sliding_window or clip_qkv, edited on the live config): this TieredCache "
                             "holds KV computed under the old one, and its sliding layers keep the old window. "
                             "Edit the config between turns, then open the cache: cache = store.open(model, input_ids)")
        experts = _experts_of(static.experts_configs) if static is not None else self.model_info.experts
        if decode and experts != self.model_info.experts and experts == _decode_kernels(self.model_info.experts):
            # generate() runs the forwards after its prefill with MoE experts on their decode kernel
            # on a GPU (_optimize_model_for_decode), as plain generate does: let through, but their
            # KV (1e-5 apart) is not kept under the opened kernel's fingerprint. The next turn
            # computes those tokens again, in its prefill, as plain generate would.
            done = self.get_seq_length()
            self._masked_from = done if self._masked_from is None else min(self._masked_from, done)
        elif experts != self.model_info.experts:
            raise ValueError(f"the model's MoE experts implementation changed since store.open (from "
                             f"{self.model_info.experts!r} to {experts!r}): its KV "
                             "differs in the last bits, and this TieredCache holds the other's. Set it first "
                             "(model.set_experts_implementation(...)), then open the cache: "
                             "cache = store.open(model, input_ids)")
        if adapters and not weights and static is not None and self.model_info.weights_state is not None and \
                self.get_seq_length():
            # A weight sync between open and a prefill (load_state_dict in place, in another
            # thread) would have the KV the cache holds (restored, or computed by an earlier
            # generate) served to the new weights. Its
            # counters, read in a few microseconds, say so; the fingerprint, taken again then,
            # says whether the weights did change. (A write through p.data moves no counter:
            # commit's whole fingerprint still sees it, after the turn.)
            moved = (id(static.sample), versions(static.sample.params)) != self.model_info.weights_state
            if moved and describe_model(opened).fingerprint != self.model_info.fingerprint:
                raise ValueError(f"the {type(opened).__name__}'s weights changed since store.open (a weight sync, "
                                 "load_state_dict): this TieredCache holds KV the old weights computed, which the "
                                 "new ones would be given. Change the weights between turns, and open the cache "
                                 "after: cache = store.open(model, input_ids)")
        if adapters and self.model_info.adapters:
            if static is not None and _adapter_state(static.adapters) != self.model_info.adapters:
                raise ValueError("the model's peft adapters changed since store.open (set_adapter, disable_adapter(), "
                                 "a new scale, or adapter_names= given to generate): this TieredCache holds KV for the "
                                 "adapters active then. Switch adapters first, then open the cache: "
                                 "cache = store.open(model, input_ids)")
        # After the checks above, whose errors say which of the fingerprint's parts changed.
        if weights and describe_model(opened, as_opened=self.model_info).fingerprint != self.model_info.fingerprint:
            raise ValueError(f"the {type(opened).__name__}'s weights, config, dtype or device changed since store.open "
                             "(its config: a field its KV depends on, such as sliding_window or clip_qkv): the "
                             "KV this TieredCache holds was computed by another model than the one it would be "
                             "kept for, so nothing is kept. Commit a turn before changing the model, and open "
                             "the next turn's cache after: cache = store.open(model, input_ids)")

    def _check_kernels(self) -> None:
        """torch's matmul precision and kernel switches are those the cache was opened under."""
        info = self.model_info
        precision = _matmul_precision(info.device, info.kv_dtype)
        if precision != info.precision:
            raise ValueError(f"torch's matmul precision changed since store.open (from "
                             f"{info.precision or 'the default'!r} to {precision or 'the default'!r}: "
                             "torch.set_float32_matmul_precision, allow_tf32): KV at the other precision differs, "
                             "and this TieredCache holds KV computed at the one it was opened at. Set it first, "
                             "then open the cache: cache = store.open(model, input_ids)")
        switches = _kernel_switches(info.device, info.attention)
        if switches != info.switches:
            was, now = (set((read or "").split(",")) - {""} for read in (info.switches, switches))
            raise ValueError(f"torch's kernel switches changed since store.open (from "
                             f"{info.switches or 'the defaults'!r} to {switches or 'the defaults'!r}; "
                             f"differing: {', '.join(sorted(was ^ now))}: "
                             "torch.nn.attention.sdpa_kernel, torch.backends.cuda.enable_flash_sdp, "
                             "torch.backends.mkldnn.flags, torch.set_num_threads, or a forward run in another "
                             "thread than the open, on its own thread count): other kernels' KV differs in the "
                             "last bits, and this TieredCache holds the other's. Open the cache under the same "
                             "settings, inside the same `with ...:` block as the generate: "
                             "cache = store.open(model, input_ids)")

    def _is_fine(self, module: torch.nn.Module) -> bool:
        if self._model is None or module is self._model():
            return True
        return any([ref() is module for ref in self._also_fine])

    def _check_model(self, module: torch.nn.Module) -> None:
        """A forward on a model other than the one this cache was opened with is refused, unless
        it computes the same KV: a part of that model (a wrapper's inner model, whose own hook
        runs inside the wrapper's forward), a model it is a part of (whose forward runs it, under
        its own hook), or a model of the same fingerprint (a copy). Otherwise ``commit`` would
        store its KV under the opened model's fingerprint, and every later turn of that model
        would restore it. Checked once per cache and model object."""
        if self._is_fine(module):
            return
        opened = self._model() if self._model is not None else None
        fine = [ref() for ref in self._also_fine]
        # Related to the opened model or to one found fine (a copy's own inner model, whose hook
        # runs inside the copy's forward). A direct child first: the inner model of every
        # transformers wrapper, met at each turn's first forward, where the walk of every
        # module took 20-50 us.
        related = (opened is not None and any([m is module for m in opened._modules.values()])) or \
            any([m is module for known in (opened, *fine) if known is not None for m in known.modules()]) or \
            any([m is opened or any([m is f for f in fine]) for m in module.modules()])
        if not related and describe_model(module).fingerprint != self.model_info.fingerprint:
            was = f"{type(opened).__name__} object" if opened is not None else "model that no longer exists"
            raise ValueError(f"this TieredCache was opened with another {was}, whose weights or config differ "
                             f"from this {type(module).__name__}'s: its KV would be stored as the other model's. "
                             "Open a cache with the model that runs it: cache = store.open(model, input_ids)")
        self._also_fine.append(weakref.ref(module))

    def _check_prefix(self, input_ids: torch.Tensor, whole: bool = False) -> None:
        """generate()'s ids, which hold those the cache holds KV for (see ``_check_generate_ids``):
        before the cache's first forward, every row must start with the tokens it restored; at the
        prefill of a later generate() on the same cache (``whole``), with every id it holds, the
        conversation's and those fed after it. Forwards feed the model only the ids past what
        the cache holds, which ``_check_inputs`` checks: an id edited before them (a reply
        edited, then sent back on the same cache) would be given the KV of the one it replaced."""
        done = self.get_seq_length()
        restored = self.restored_tokens
        if not (whole or (restored and done == restored)) or not done or input_ids.shape[1] < done:
            return  # nothing held, a decode step, or fewer ids (the forward hook refuses them)
        got = input_ids[:, :done].detach().cpu().numpy()
        want = self.input_ids
        n = min(done, len(want))
        if not _rows_equal(got[:, :n], want[:n]):
            if got.shape[0] > 1 and not (got == got[:1]).all():
                raise ValueError(f"a TieredCache holds one conversation, but generate() got a batch of {got.shape[0]} "
                                 f"rows that differ within the {done} tokens it holds KV for, which would all get "
                                 "it; open one cache per conversation and generate each with batch 1")
            at = int(np.argmax((got[:, :n] != want[:n]).any(axis=0)))
            how = "restored for them" if at < restored else "computed for them in an earlier generate()"
            raise ValueError(f"generate() was given ids that differ from those store.open got at token {at}, whose KV "
                             f"this TieredCache {how}: generate() takes the whole conversation given to store.open, "
                             "not only the new message; for other ids, open a cache with them")
        if done > n and not self._rows_diverged:
            fed, _ = self._fed_ids(n, done)
            known = fed >= 0
            if not (got[:, n:][:, known] == fed[known]).all():
                at = n + int(np.argmax(((got[:, n:] != fed) & known).any(axis=0)))
                raise ValueError(f"generate() was given ids that differ at token {at} from those an earlier generate() "
                                 "on this TieredCache computed KV for (a reply edited before it was sent back?): "
                                 "commit the cache with the sequences that generate() returned, then open a new one "
                                 "with the edited conversation: cache = store.open(model, input_ids)")

    def _check_inputs(self, input_ids: Any, kwargs: dict[str, Any], done: int, extends: bool = False) -> None:
        """A forward's inputs. While the cache holds less than its conversation they must be its
        next ids (every row alike, where beams expand the batch), at their own positions, as ids
        (not embeddings, not with token types), under at most a 2-D mask; a mask that hides a
        token ends what ``commit`` keeps there, and one that hides a restored token is refused.
        Past the conversation, the ids fed are noted (no device sync) for ``commit``; the whole
        conversation fed again there is refused. Layers that disagree (a forward that raised
        part-way) refuse every forward. ``extends``: generate() feeds ids past the cache (``_check_generate_ids``)."""
        want = self.input_ids
        # The first and last layers' keys and values: a forward, crop, reset or change of rows
        # goes through the layers in order, keys before values, so one cut short part-way (out
        # of memory, Ctrl-C, another signal's handler) leaves them apart there.
        first, last = self._kv[0].extent(), self._kv[-1].extent()
        if {first[1], *last[:2]} != {done}:
            behind = [t for t in (*last[:2], first[1]) if t != done][0]
            # A forward that raised part-way left the first layers a token or more ahead of the
            # last; a crop cut short left a layer's values ahead of its keys (helper-90: the next
            # forward got past this check and raised inside attention, a shape error). A forward
            # now would put the new tokens' KV at other positions in each.
            ahead = sum(layer.held_tokens() == done for layer in self._kv)
            raise ValueError(f"this TieredCache's last forward did not finish (or a crop or reset of it): it "
                             f"stopped after {ahead} of its {len(self._kv)} layers (an exception such as out of "
                             f"memory or Ctrl-C), which now hold {done} and {behind} tokens, and a forward would "
                             "compute wrong KV. Commit it (commit keeps the tokens every layer holds) and open a new "
                             "cache with store.open, or call cache.reset() to empty this one and compute the "
                             "conversation again")
        if len({first[2], first[3], last[2], last[3]} - {0}) > 1:
            # A row selection, reorder or repeat cut short part-way (helper-90: torch's shape
            # error in the next forward's concatenation). generate() cuts the rows to one itself.
            raise ValueError("this TieredCache's layers hold different numbers of rows (batch_select_indices, "
                             "reorder_cache or batch_repeat_interleave did not finish: an exception cut it short): "
                             "call cache.batch_select_indices(torch.tensor([0])) to keep one row in every layer, "
                             "or commit it and open a new cache with store.open")
        if self.model_info.positions_from_pad and kwargs.get("position_ids") is None:
            # Its KV at positions generate() never uses: a turn run by model() and the next by
            # generate() would meet in one conversation at two sets of positions.
            raise ValueError("this model counts positions from its pad id when a forward is given no position_ids, "
                             "while generate() passes them counted from 0: pass position_ids=torch.arange(start, "
                             "start + n)[None] to model(), start being cache.get_seq_length()")
        embeds = kwargs.get("inputs_embeds")
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and isinstance(input_ids, torch.Tensor) and \
                input_ids.dim() == 2 and mask.shape[1] != done + input_ids.shape[1]:
            # A 2-D mask covers the cached tokens and the new ones. generate() given ids shorter than
            # the cache feeds a slice of them, at other positions, with a mask as long as the ids.
            raise ValueError(f"the model was given {input_ids.shape[1]} ids on top of the {done} this TieredCache "
                             f"holds, with an attention_mask over {mask.shape[1]} tokens rather than "
                             f"{done + input_ids.shape[1]}: generate() takes the whole conversation, the cache's "
                             "ids and the new ones (and model() a mask over both)")
        rows = self.batch_rows()
        given = input_ids if isinstance(input_ids, torch.Tensor) else embeds
        if rows > 1 and done and isinstance(given, torch.Tensor) and given.dim() >= 2 and given.shape[0] != rows:
            # Past the conversation or cropped back inside it (helper-38: torch's error there);
            # generate() cuts them to one first.
            raise ValueError(f"this TieredCache holds {rows} rows (beams or num_return_sequences), and the model "
                             f"was given {given.shape[0]}: commit it (which keeps the conversation's KV) and open "
                             "a new cache, or pick a row first with cache.batch_select_indices")
        if done >= len(want):
            self._note_past(input_ids, embeds, kwargs, done, extends)
            return
        if embeds is not None:
            raise ValueError("a TieredCache was given inputs_embeds; its blocks are keyed on token ids, so KV "
                             "computed from embeddings (soft prompts, prompt tuning) would be served for those ids. "
                             "Pass input_ids, or use a plain DynamicCache for this turn")
        unkeyed = _unkeyed_input(kwargs)
        if unkeyed is not None:
            raise ValueError(f"a TieredCache was given {unkeyed}, which change the KV of the ids it is keyed on "
                             "(its blocks are keyed on the ids alone); pass input_ids alone, with attention_mask "
                             "or position_ids if need be, or use a plain DynamicCache for this turn")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            return  # the model rejects it itself
        got = input_ids.detach().cpu().numpy()
        n = min(got.shape[1], len(want) - done)
        # Rows compared as bytes, here and below: numpy's comparisons, cold on a turn's first
        # forward, cost more than all else this check does.
        if not _rows_equal(got[:, :n], want[done:done + n]):
            if got.shape[0] > 1 and not (got == got[:1]).all():
                raise ValueError(f"a TieredCache holds one conversation, but the model got a batch of {got.shape[0]} "
                                 "different rows; open one cache per conversation and generate each with batch 1")
            raise ValueError(f"the model was given ids that are not this cache's conversation from token {done} on "
                             f"(it holds {done} of the {len(want)} ids store.open got): generate() takes the whole "
                             "conversation given to store.open, not only the new message; model() takes the ids "
                             "past cache.get_seq_length()")
        hidden = self._hidden_token(kwargs.get("attention_mask"))
        positions = kwargs.get("position_ids")
        if isinstance(positions, torch.Tensor):
            # Up to the first hidden token: generate() shifts the positions after it, which are not kept.
            k = n if hidden is None else max(0, min(n, hidden - done))
            at = positions.detach().reshape(-1, positions.shape[-1])[:, :k].cpu().numpy()
            if not _rows_equal(at, np.arange(done, done + k, dtype=np.int64)):
                raise ValueError(f"a TieredCache's tokens must sit at their own positions: the model was given "
                                 f"position_ids that do not start at {done} and count up; pass position_ids=None")
        if hidden is not None:
            self._masked_from = hidden if self._masked_from is None else min(self._masked_from, hidden)
        if got.shape[1] > n:  # this forward goes on past the conversation (assisted decoding's candidates)
            # Its mask was read above, into _masked_from.
            self._note(len(want), input_ids[:, n:], None,
                       positions[..., n:] if isinstance(positions, torch.Tensor) else None)

    def _prepared_ids(self, input_ids: torch.Tensor) -> bool:
        """``input_ids`` are those generate() prepared a forward of past the cache with (or it is
        not known which): not a forward of another caller at that length. One after a generate()
        that raised between the two (out of memory, Ctrl-C, in its forward before any layer) was
        taken for it, and the whole conversation fed again passed unrefused."""
        prepared = self._prepared
        if prepared is None or prepared is _UNPREPARED:
            return prepared is None
        return prepared.shape == input_ids.shape and torch.equal(prepared.to(input_ids.device), input_ids)

    def _note_past(self, input_ids: Any, embeds: Any, kwargs: dict[str, Any], done: int, extends: bool = False
                   ) -> None:
        """A forward past the conversation: noted for ``commit``, which keeps its KV only where it
        was computed from known ids, unmasked, at their own positions. Ids that start with the
        whole conversation are refused as fed again, unless generate() took them from past the
        cache (``extends``): a reply that repeats the conversation, or assisted decoding's
        candidates after a reply that began it again."""
        want = self.input_ids
        mask = kwargs.get("attention_mask")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
            self._hidden_token(mask)  # raises: a custom mask
        if embeds is not None or _unkeyed_input(kwargs) is not None or \
                not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            self._fed.append(_Fed(done, None))
            return
        # generate() given a cache that holds every id it is given feeds them all again. Read
        # (a device sync) only for a forward as long as the conversation, never a decode step.
        if input_ids.shape[1] >= len(want) > 1 and \
                (input_ids[0, :len(want)].detach().cpu().numpy() == want).all() and \
                not (extends and self._prepared_ids(input_ids)):
            if kwargs.get("use_cache") is False:
                raise ValueError(_NO_CACHE_USE)
            if done == len(want) > self.restored_tokens and input_ids.shape[1] == done + 1:
                # Right after a prefill this cache computed: the model's own generate() re-feeds
                # every id at each step (one that ignores the cache it is given), not the caller.
                raise ValueError(f"the model was given all {done + 1} ids on top of the {done} this "
                                 "TieredCache computed a step before: its generate() feeds every id at "
                                 "every step instead of the ids past the cache, so it cannot use a TieredCache; "
                                 "generate with it without tierkv")
            raise ValueError(f"this TieredCache already holds all {len(want)} ids it was opened with, and "
                             "the model was given them again (generate() on a cache that holds every id "
                             "feeds the whole conversation on top of it): their KV would be held twice. "
                             "Commit this cache and open a new one with the conversation and its new "
                             "message (store.open restores at most all but the last id)")
        positions = kwargs.get("position_ids")
        positions = positions if isinstance(positions, torch.Tensor) else None
        if positions is not None and positions.dim() and positions.shape[-1] != input_ids.shape[1]:
            # generate() with prefill_chunk_size on a cache that holds every id it is given feeds
            # its first chunk with the positions past the cache: none.
            raise ValueError(f"the model was given {input_ids.shape[1]} ids with position_ids for "
                             f"{positions.shape[-1]} tokens on top of the {done} this TieredCache holds (generate() "
                             "given no more ids than the cache holds feeds so, with prefill_chunk_size or beams): "
                             "pass the whole conversation the cache holds and its new ids, or commit this cache "
                             "and open a new one with the conversation and its new message")
        # Read (a sync) for a forward of several ids only, never a decode step; generate() counts
        # positions over the mask, so past a masked token they stay behind the cache's length.
        if positions is not None and input_ids.shape[1] > 1 and (mask is None or bool(mask.all())) and \
                int(positions.detach().reshape(-1)[0]) != done:
            # generate() given fewer ids than the cache holds feeds the last of them at their
            # positions in those ids, not after the cache.
            raise ValueError(f"the model was given {input_ids.shape[1]} ids at positions from "
                             f"{int(positions.reshape(-1)[0])} on, but this TieredCache holds {done} tokens: "
                             "generate() takes the whole conversation the cache holds and its new ids (pass the "
                             "sequences the last generate() returned, with the new message appended; after a "
                             "generate() that raised, commit the cache with the ids you have, which keeps the KV "
                             "up to them, and open a new one)")
        self._note(done, input_ids, mask if isinstance(mask, torch.Tensor) else None, positions)

    def _note(self, at: int, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None) -> None:
        if ids.shape[0] > 1:
            self._rows_diverged = True
        if self._masked_from is not None and at >= self._masked_from:
            # Nothing from there on is kept: no copies, and no reduction over a mask as long as the
            # cache (generate() passes a mask only when it hides a token, a pad it masked before).
            return
        self._fed.append(_Fed(at, ids[0].clone(), None if mask is None else mask.all(),
                              None if positions is None else positions.clone()))

    def _hidden_token(self, mask: Any) -> int | None:
        """The first token a 2-D attention mask hides, None if none; other masks are refused."""
        if mask is None:
            return None
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            raise ValueError("a TieredCache takes a 2-D attention_mask (batch, tokens) or none; a custom mask "
                             f"({type(mask).__name__}{'' if not isinstance(mask, torch.Tensor) else f' of {mask.dim()} dims'}) "
                             "makes the KV depend on more than the ids it is keyed on: pass a 2-D mask of the "
                             "conversation's tokens (1 kept, 0 hidden), or use a plain DynamicCache for this turn")
        if bool(mask.all()):
            return None
        # KV computed under a mask is not a function of the ids alone: nothing from the first
        # hidden token on is committed, and KV restored from unmasked turns cannot meet it.
        hidden = int(torch.nonzero(mask[0] == 0)[0, 0]) if not bool(mask[0].all()) else int(mask.shape[1])
        # Restored KV still held: after a crop below it, what was restored there is computed again.
        if hidden < self._restored_held:
            raise _restored_hidden(hidden)
        return hidden

    def _fed_ids(self, start: int, stop: int) -> tuple[np.ndarray, int]:
        """The ids the model was fed at positions ``[start, stop)``, later forwards overriding
        earlier ones (assisted decoding crops rejected tokens and feeds others), and where what
        was fed stops being known ids: the first position never fed, or fed as embeddings, under
        a mask that hid a token, or at other positions than its own."""
        out = np.full(max(0, stop - start), -1, dtype=np.int64)
        fed = self._fed
        # One read each (a device sync on CUDA), for every forward at once.
        flat = _flat_numpy([f.ids for f in fed if f.ids is not None])
        unmasked = [f.unmasked for f in fed if f.unmasked is not None]
        unmasked_at = torch.stack(unmasked).cpu().numpy().tolist() if unmasked else []
        positions = _flat_numpy([f.positions for f in fed if f.positions is not None])
        i = m = p = 0
        for f in fed:
            at = f.at
            if f.ids is None:
                known = False
            else:
                k = int(f.ids.numel())
                known = True
                if f.unmasked is not None:
                    known = bool(unmasked_at[m])
                    m += 1
                if f.positions is not None:
                    rows = int(f.positions.numel()) // max(1, k)
                    given = positions[p:p + rows * k].reshape(rows, k) if rows * k == f.positions.numel() else None
                    p += int(f.positions.numel())
                    known = known and given is not None and bool((given == np.arange(at, at + k)).all())
            if not known:
                lo = max(at, start) - start
                if lo < len(out):
                    out[lo:] = -1
                if f.ids is not None:
                    i += k
                continue
            lo, hi = max(at, start), min(at + k, stop)
            if lo < hi:
                out[lo - start:hi - start] = flat[i + lo - at:i + hi - at]
            i += k
        missing = np.flatnonzero(out < 0)
        return out, start + (int(missing[0]) if len(missing) else len(out))

    def activate_past_recording(self, **kwargs: Any) -> None:
        # transformers calls this only when assisted decoding starts; see the module docstring.
        # (5.25's DeferredStopCheck also calls it after a prefill, on MPS only, which
        # resolve_device refuses: there this would throw away KV the prefill just computed.)
        # 5.25 passes how many recurrent states to keep (for linear-attention layers, which a
        # TieredCache never holds); 5.24 passes nothing and its base takes nothing.
        if self.get_seq_length() > 0:
            # In reset()'s order, for its reasons.
            self._store._discard_restore(self)
            for layer in self._kv:
                layer.reset()
            self._forget_forwards()
        super().activate_past_recording(**kwargs)

    # What a forward the hook never saw writes after these is neither counted as checked nor
    # known by the ids fed before them there.
    def crop(self, *args: Any, **kwargs: Any) -> None:
        tokens = _count(args[0] if args else kwargs.get("tokens_to_remove"))
        if tokens is not None and tokens < 0:
            # Checked before any layer is cut: a refusal part-way left the layers apart.
            length, floor = self.get_seq_length() + tokens, self.crop_floor()
            if 0 < length < floor:
                raise _crop_refusal(floor, length, self.model_info.cut_layers)
        super().crop(*args, **kwargs)
        self._extends = None  # a forward prepared before the crop ran already (assisted decoding's)
        length = self.get_seq_length()
        if not length:
            # Empty (1, H, 0, D) layers would meet beams unexpanded (transformers repeats only
            # layers that hold tokens): reset, they take any batch, as a fresh cache's do.
            for layer in self._kv:
                layer.reset()
        if length < self._restored_held:  # not a decode step's crop past the restore: no lock, no copy there
            self._store._give_back(self, length)
            # The restored blocks the crop left no token of: the turn computes those tokens again,
            # its own KV, and a forget of those blocks since the open no longer cuts its commit
            # at them (as after a reset; a crop to nothing kept none).
            self._restored_keys = self._restored_keys[:-(-length // self._store.block_size)]
        if self._masked_from is not None and self._masked_from >= length:
            self._masked_from = None  # no KV left that a mask hid a token from
        self._fed = [f if f.ids is None or f.at + f.ids.numel() <= length else _crop_fed(f, length)
                     for f in self._fed if f.at < length]
        if length <= len(self.input_ids):
            self._rows_diverged = False  # no KV past the conversation is left

    def reset(self) -> None:
        # The restored prefix is thrown away and computed again: no longer restored (masks over
        # it are then allowed), and counted as missed, as for assisted decoding. Each step leaves a
        # cache that a reset made again finishes, and a state a turn can go on from: the discard
        # first (the store's count and the cache's in one statement), restored KV still held
        # then counting as KV the cache computed, which it equals; then the layers (a turn going
        # on from layers left apart is refused, saying to reset); then the notes of forwards whose
        # KV no layer holds any longer (h128).
        if self.restored_tokens:
            self._store._discard_restore(self)
        super().reset()
        self._forget_forwards()

    def _drop_unverified(self, mask: Any = None) -> None:
        """Before a generate()'s prefill on a cache that holds more than it restored (it reads the
        cache's length then), the KV this generate() cannot vouch for is dropped, so that it
        computes those tokens again from its own ids and mask:

        * KV past the conversation computed for several rows (samples, beams): only row 0's ids
          were recorded, and the rows follow the last step's beams, not the sequences returned
          (a DynamicCache there gives each row's KV to whatever ids sit in that row);
        * from the first token past the conversation whose ids are not known (fed as embeddings,
          under a mask that hid a token, at other positions): the prefix check compares known
          ids only (found by helper-34: another message's KV was served, logits 0.8 off);
        * from the first token the cache computed (not restored) that this generate()'s mask
          hides (a pad id generate() masks in an earlier reply): the KV after it was computed
          unmasked, at positions the mask now shifts (helper-34: logits 4e-3 off);

        and several rows left, alike over the conversation, are cut to one: generate() computes
        in as many rows as it asks for, as after a restore."""
        n = len(self.input_ids)
        done = self.get_seq_length()
        keep = done
        if done > n:
            if self._rows_diverged:
                keep = n
            else:
                fed, _ = self._fed_ids(n, done)
                unknown = np.flatnonzero(fed < 0)
                if len(unknown):
                    keep = n + int(unknown[0])
        if self._masked_from is not None:
            # An earlier forward's mask hid a token of the conversation: the KV after it sits at
            # the positions that mask gave, which this generate()'s mask need not give.
            keep = min(keep, self._masked_from)
        held = self._restored_held
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[-1] >= keep:
            hidden = np.flatnonzero((mask[:, :keep] == 0).any(dim=0).cpu().numpy())
            if len(hidden) and int(hidden[0]) < held:
                raise _restored_hidden(int(hidden[0]))  # as at a first generate
            if len(hidden):
                keep = int(hidden[0])
        if keep < done:
            # Noted first: a generate() that raises after this drop (out of memory, Ctrl-C, a
            # handler's timeout, in the crop itself) leaves the caller the ids it had before it,
            # whose commit keeps the KV up to them as before the drop, not a refusal saying to run
            # generate() (helper-90).
            self._dropped_from = max(done, self._dropped_from or 0)
            # Never below a cut sliding layer's floor: what is kept is at least what was restored.
            self.crop(keep - done)  # transformers takes a count to drop
        if self._several_rows():  # (a crop to nothing resets the layers: any batch meets them)
            first = torch.zeros(1, dtype=torch.long, device=self._kv[0].keys.device)
            self.batch_select_indices(first)
        self._rows_diverged = False

    def crop_floor(self) -> int:
        """The shortest length a crop can leave the cache (0 but where a sliding layer holds the
        restored conversation from where its window reaches)."""
        return max([layer.crop_floor() for layer in self._kv])

    def held_from(self) -> int:
        """The first token whose KV every layer holds (a sliding layer's restore is cut to its
        window): ``block_tensor`` reads blocks from there on. Layers still pending count with the
        cut their assembly will make: a commit before any forward asked first, found 0, and then
        read a block below the cut at a negative index of the layer assembled meanwhile."""
        return max([layer.held_from() for layer in self._kv])

    def _forget_forwards(self) -> None:
        """What the hook noted of forwards whose KV the cache no longer holds, and the blocks the
        store restored it from (a reset's last step: every layer emptied before it)."""
        # One statement: cut part-way, a stale note of a mask or of dropped KV made the next
        # commit keep less, or refuse less, than it should. The restored blocks' keys too: a
        # reset turn computes the conversation again, its own, and a forget of those blocks
        # since the open cut its commit at the first of them (``_first_forgotten``: 0 of 45
        # tokens kept; h128), as if it still held KV restored from them.
        self._fed, self._masked_from, self._rows_diverged, self._dropped_from, self._restored_keys = \
            [], None, False, None, []

    # -- for the store ---------------------------------------------------------------------------
    def held_tokens(self) -> int:
        """Tokens whose KV every layer holds: ``get_seq_length()`` (layer 0's) unless a forward
        raised part-way through the layers."""
        return min(layer.held_tokens() for layer in self._kv)

    def most_tokens(self) -> int:
        """The most tokens any layer's keys or values hold: more than ``held_tokens`` where a
        forward, crop or reset stopped part-way through the layers."""
        return max(max(layer.extent()[:2]) for layer in self._kv)

    def kv_dtypes(self) -> set[torch.dtype]:
        """The dtypes of the keys and values every layer computed (a layer still waiting for its
        restore holds the store's, in the model's dtype)."""
        return {t.dtype for layer in self._kv for t in (layer._keys, layer._values)
                if t is not None and t.numel()}

    def batch_rows(self) -> int:
        return max(1, self._kv[0]._rows())

    def _several_rows(self) -> bool:
        """Whether a layer holds several rows, without assembling a pending restore (one row).
        Every layer's keys and values: a ``batch_select_indices`` cut short part-way left the
        first layers at one row and the others at several (helper-90: generate() then went on
        with one row, and torch's concatenation raised in the first layer still holding two)."""
        return any([max(layer.extent()[2:]) > 1 for layer in self._kv])

    def block_tensor(self, start: int, end: int) -> torch.Tensor:
        """KV of tokens ``[start, end)`` of batch row 0, shape (layers, 2, kv_heads, tokens, head_dim)
        (``(slots, 2, ...)`` for layers of other KV shapes: ``layout.py``).
        Without autograd history: KV from a forward run with grad enabled (``model()`` outside
        ``torch.no_grad()``) holds that forward's graph, every activation it saved, which a
        stored block must not keep alive outside every budget. Detached rather than stacked under
        ``torch.no_grad()``: another signal's handler raising as that block's exit began left
        autograd off in the caller's thread for good."""
        if start < self.held_from():
            raise ValueError(f"tokens {start} to {end}: this cache's sliding layers hold the conversation from "
                             f"token {self.held_from()} on")
        layout = self.model_info.layout
        if layout is None:
            return torch.stack([torch.stack([t.detach() for t in layer.span(start, end)]) for layer in self.layers]
                               ).contiguous()
        keys = self._kv[0].keys
        block = layout.empty(end - start, keys.dtype, keys.device)
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, TieredLayer):
                continue  # reads another layer's KV
            keys, values = layer.span(start, end)
            layout.fill(block, i, keys.detach(), values.detach())
        return block


# The caches the wrappers of prepare_inputs_for_generation look into (_check_generate_ids).
_CHECKED_CACHES = (TieredCache, EncoderDecoderCache)


def _install_tiered_self_attention() -> None:
    """Let an ``EncoderDecoderCache`` whose self-attention cache is a ``TieredCache`` be cropped
    and cut to rows as one holding a ``DynamicCache`` is. GPT-2 built with ``add_cross_attention``
    wraps whatever cache it is given in one (an empty cross-attention cache beside it: tierkv
    refuses encoder states), and generate() then crops that wrapper in assisted decoding, whose
    check (``check_dynamic_cache``) refused anything but a ``DynamicCache``: prompt lookup and
    assistant models raised a TypeError there, where a ``DynamicCache`` runs (found by helper-73).
    Any other self-attention cache meets transformers' own check, as before."""
    defined = getattr(EncoderDecoderCache, "check_dynamic_cache", None)
    if not callable(defined) or getattr(defined, "_tierkv", False):
        return

    @functools.wraps(defined)
    def check_dynamic_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self.self_attention_cache, TieredCache) and isinstance(self.cross_attention_cache, DynamicCache):
            return None
        return defined(self, *args, **kwargs)

    check_dynamic_cache._tierkv = True  # type: ignore[attr-defined]
    EncoderDecoderCache.check_dynamic_cache = check_dynamic_cache  # type: ignore[method-assign]


_install_tiered_self_attention()


def _crop_fed(fed: _Fed, length: int) -> _Fed:
    """A forward's record cut to the positions before ``length``."""
    k = length - fed.at
    assert fed.ids is not None
    return fed._replace(ids=fed.ids[:k], positions=None if fed.positions is None else fed.positions[..., :k])


def _flat_numpy(tensors: list[torch.Tensor]) -> np.ndarray:
    return torch.cat([t.reshape(-1) for t in tensors]).cpu().numpy() if tensors else np.empty(0, np.int64)
