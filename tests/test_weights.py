"""The weight sample behind fingerprints (tierkv/weights.py): the CPU gather reads exactly what one
``take`` per parameter reads, and any change to which tensors a model holds is noticed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ARCHITECTURES, make_model
from tierkv.cache import describe_model
from tierkv.weights import WeightSample, persistent_buffers, sample_index


def reference_bytes(model: torch.nn.Module) -> bytes:
    """What one ``take`` per parameter reads, as the elements' bits: grouped by element size, in
    parameter order in each group (the format of ``WeightSample.read``); the persistent buffers
    (Gemma 4's ``layer_scalar``) after the parameters."""
    groups: dict[int, list[bytes]] = {}
    with torch.no_grad():
        for p in (*model.parameters(), *persistent_buffers(model)):
            data = p.detach()
            if not (data.is_neg() or data.is_conj()):  # read as its values, not its bits
                data = data.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(
                    data.element_size(), data.dtype))
            taken = torch.take(data, sample_index(p.numel(), p.device)).contiguous()
            groups.setdefault(p.element_size(), []).append(taken.view(torch.uint8).numpy().tobytes())
    return b"".join(b for size in sorted(groups) for b in groups[size])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_cpu_gather_reads_what_take_reads(dtype):
    model = make_model("llama", seed=3).to(dtype)
    sample = WeightSample(model)
    assert sample._host is not None  # the path under test
    assert sample.read() == reference_bytes(model) == sample.read_with_torch()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_architecture_reads_the_same_bytes(arch):
    # Tied embeddings (gpt2, opt...) appear once in parameters(): the sample follows that order.
    model = make_model(arch, seed=1)
    assert WeightSample(model).read() == reference_bytes(model)


def test_strided_scalar_empty_and_mixed_dtype_parameters():
    model = make_model("llama", seed=4)
    model.lm_head.weight = torch.nn.Parameter(torch.randn(model.lm_head.in_features, model.lm_head.out_features).t())
    assert not model.lm_head.weight.is_contiguous()
    model.model.norm.register_parameter("scale", torch.nn.Parameter(torch.tensor(2.5)))
    model.model.norm.register_parameter("nothing", torch.nn.Parameter(torch.empty(0, 3)))
    mlp = model.model.layers[0].mlp
    mlp.up_proj.weight.data = mlp.up_proj.weight.data.to(torch.bfloat16)
    mlp.down_proj.weight.data = mlp.down_proj.weight.data.to(torch.float16)
    sample = WeightSample(model)
    assert sample._host is not None
    assert sample.read() == reference_bytes(model)


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, torch.int64, torch.complex64])
def test_any_dtype_of_at_most_8_bytes_is_read_by_address(dtype):
    model = make_model("llama", seed=4)
    values = torch.arange(40) % 3
    model.model.norm.register_parameter("q", torch.nn.Parameter(values.to(dtype), requires_grad=False))
    sample = WeightSample(model)
    assert sample._host is not None
    assert sample.read() == reference_bytes(model) == sample.read_with_torch()


class _Params(torch.nn.Module):
    def __init__(self, **params: torch.Tensor) -> None:
        super().__init__()
        for name, value in params.items():
            self.register_parameter(name, torch.nn.Parameter(value, requires_grad=False))


def test_elements_of_every_size_are_read_from_one_span_whatever_its_first_address():
    # The lowest sampled address is a byte at an odd address: the views of wider elements must
    # start below it, at an address their indices divide, not at it.
    buf = torch.arange(1024, dtype=torch.int64).to(torch.uint8)
    model = _Params(a=buf[1:17], b=buf[24:56].view(torch.int16), c=buf[64:128].view(torch.float32),
                    d=buf[128:256].view(torch.float64))
    sample = WeightSample(model)
    assert sample._host is not None
    assert sample.read() == reference_bytes(model) == sample.read_with_torch()


def test_bits_are_read_as_they_lie_on_either_path():
    raw = torch.tensor([0, 1, 2, 255] * 10, dtype=torch.uint8)
    model = _Params(flags=raw.view(torch.bool), f8=torch.randn(40).to(torch.float8_e4m3fn),
                    u16=torch.arange(40, dtype=torch.int16).view(torch.uint16))
    sample = WeightSample(model)
    assert sample._host is not None
    assert sample.read() == reference_bytes(model) == sample.read_with_torch()  # bool bytes 2, 255 kept


def test_dtypes_take_lacks_are_read_through_integers_when_not_by_address():
    u32 = torch.arange(40, dtype=torch.int32).view(torch.uint32)
    model = _Params(f8=torch.randn(40).to(torch.float8_e4m3fn), u32=u32,
                    c=torch.randn(4, dtype=torch.complex128))  # 16-byte elements: take for all
    sample = WeightSample(model)
    assert sample._host is None
    assert sample.read() == reference_bytes(model)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
@pytest.mark.parametrize("view", ["conj", "quantised"])
def test_views_whose_values_are_not_their_bits_are_not_read_by_address(view):
    if view == "conj":
        value = torch.randn(40, dtype=torch.complex64).conj()
    else:
        value = torch.quantize_per_tensor(torch.randn(40), 0.1, 0, torch.qint8)
    sample = WeightSample(_Params(v=value))
    assert sample._host is None
    if view == "conj":
        assert sample.read() == torch.take(value, sample_index(40)).resolve_conj().view(torch.uint8).numpy().tobytes()


def test_wider_elements_go_through_take():
    model = make_model("llama", seed=4)
    model.model.norm.register_parameter("c", torch.nn.Parameter(torch.randn(40, dtype=torch.complex128)))
    sample = WeightSample(model)
    assert sample._host is None
    assert sample.read() == reference_bytes(model)


def test_an_unaligned_parameter_goes_through_take():
    model = make_model("llama", seed=4)
    odd = torch.frombuffer(bytearray(range(161)), dtype=torch.float32, offset=1, count=40)
    assert odd.data_ptr() % 4  # a numpy view of 4-byte elements cannot address it
    model.model.norm.register_parameter("odd", torch.nn.Parameter(odd, requires_grad=False))
    sample = WeightSample(model)
    assert sample._host is None
    assert sample.read() == reference_bytes(model)


def test_writes_the_framework_never_sees_change_the_sample():
    model = make_model("llama", seed=5)
    sample = WeightSample(model)
    before = sample.read()
    p = model.model.layers[1].self_attn.o_proj.weight
    # The last sampled element, written through numpy: no version counter, no hook.
    p.detach().numpy().reshape(-1)[-1] += 1.0
    assert sample.current(model) and sample.read() != before


@pytest.mark.parametrize("change", [
    "data assigned", "parameter replaced", "submodule replaced", "slot written directly",
    "parameter added", "reshaped in place", "cast",
])
def test_the_sample_is_stale_after_the_model_holds_other_tensors(change):
    model = make_model("llama", seed=6)
    sample = WeightSample(model)
    assert sample.current(model)
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        if change == "data assigned":
            attn.q_proj.weight.data = attn.q_proj.weight.data.clone()
        elif change == "parameter replaced":
            attn.q_proj.weight = torch.nn.Parameter(attn.q_proj.weight.clone())
        elif change == "submodule replaced":
            model.lm_head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=False)
        elif change == "slot written directly":
            # As Module._apply does under torch.__future__'s overwrite flag, bypassing every hook.
            attn.q_proj._parameters["weight"] = torch.nn.Parameter(attn.q_proj.weight.clone())
        elif change == "parameter added":
            attn.register_parameter("extra", torch.nn.Parameter(torch.zeros(3)))
        elif change == "reshaped in place":
            attn.q_proj.weight.data = attn.q_proj.weight.data.view(-1)  # same storage, other shape
        elif change == "cast":
            model.to(torch.float16)
    assert not sample.current(model)


def test_describe_model_follows_a_replaced_storage_to_its_new_values():
    model = make_model("llama", seed=7)
    first = describe_model(model).fingerprint
    assert describe_model(model).fingerprint == first
    w = model.model.embed_tokens.weight
    w.data = w.data.clone()  # the old storage is freed: the old addresses must not be read again
    assert describe_model(model).fingerprint == first
    with torch.no_grad():
        w.data.view(-1)[0] += 1.0
    assert describe_model(model).fingerprint != first


def test_a_square_weight_transposed_in_place_changes_the_fingerprint():
    model = make_model("llama", seed=8)
    first = describe_model(model).fingerprint
    w = model.model.layers[0].self_attn.o_proj.weight
    assert w.shape[0] == w.shape[1]
    w.data = w.data.t()  # same address, dtype and shape; other logical elements
    assert describe_model(model).fingerprint != first
    assert WeightSample(model).read() == reference_bytes(model)


def test_parameters_without_storage_of_their_own_are_not_read_by_address():
    model = make_model("llama", seed=9)
    model.model.norm.weight.untyped_storage().resize_(0)  # as FSDP frees a shard
    assert WeightSample(model)._host is None
    with pytest.raises(RuntimeError):
        describe_model(model)  # torch refuses to read it, as before: never garbage from address 0


def test_negative_views_are_read_through_take():
    model = make_model("llama", seed=10)
    w = model.model.layers[1].mlp.up_proj.weight
    w.data = torch._neg_view(w.data.neg())
    sample = WeightSample(model)
    assert sample._host is None and sample.read() == reference_bytes(model)


@pytest.mark.parametrize("dtypes", [(torch.float16,), (torch.float16, torch.float32)])
def test_nan_weights_are_read_as_their_bits_on_either_path(dtypes):
    model = make_model("llama", seed=11).to(dtypes[0])
    if len(dtypes) > 1:
        model.lm_head.to(dtypes[1])
    w = model.model.layers[0].self_attn.q_proj.weight
    w.data.view(torch.int16).view(-1)[0] = 0x7C01  # a signalling float16 NaN, sampled (element 0)
    sample = WeightSample(model)
    assert sample._host is not None
    before = sample.read()
    assert before == reference_bytes(model) == sample.read_with_torch()
    w.data.view(torch.int16).view(-1)[0] = 0x7C02  # another NaN: only its payload differs
    assert sample.read() != before and sample.read() == reference_bytes(model) == sample.read_with_torch()


_FREED_UNDER_THE_READ = """
import sys
sys.path.insert(0, {tests!r})
import torch
from conftest import make_model
from tierkv.weights import WeightSample

model = make_model("llama", vocab_size=32768)  # an 8 MiB embedding: malloc maps it on its own
sample = WeightSample(model)
weight = model.model.embed_tokens.weight
held = sample.hold()  # as describe_model holds them, from before current() until after read()
assert sample._host is not None and sample.current(model)
with torch.no_grad():
    weight.data = weight.data.clone()  # as another thread would, between current() and read()
sample.read()  # read at the old addresses: unmapped once the old storage is freed
print("READ")
"""


def test_a_storage_replaced_between_current_and_read_is_still_readable():
    script = _FREED_UNDER_THE_READ.format(tests=str(Path(__file__).parent))
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0 and "READ" in child.stdout, (child.returncode, child.stderr[-2000:])


def test_a_replaced_weight_is_freed_at_once_not_held_by_the_sample():
    import gc
    import weakref

    import numpy as np

    model = make_model("llama", seed=5)
    weight = model.lm_head.weight
    values = np.random.default_rng(0).random(tuple(weight.shape), dtype=np.float32)
    with torch.no_grad():
        weight.data = torch.from_numpy(values)  # its storage keeps ``values`` alive, and no more
    alive = weakref.ref(values)
    del values
    describe_model(model)  # samples that storage by address
    with torch.no_grad():
        weight.data = weight.data.clone()  # as model.half() or model.to(...) replace every storage
    gc.collect()
    assert alive() is None, "the fingerprint's sample kept a replaced weight's memory"


def test_the_digest_reads_every_byte_of_every_tensor_with_its_shape_and_dtype():
    # Nothing here held digest_weights to its word: one skipping a tensor (the last), or hashing
    # bytes without their shapes and dtypes, passed every test of this file.
    from tierkv.weights import digest_weights

    params = tuple(torch.arange(n * 7, dtype=torch.float32).reshape(n, 7) for n in (3, 5, 2))
    base = digest_weights(params)
    for i, p in enumerate(params):
        for where in (0, p.numel() // 2, p.numel() - 1):
            changed = [q.clone() for q in params]
            changed[i].view(-1)[where] += 1
            assert digest_weights(tuple(changed)) != base, (i, where)
    flat = torch.arange(12, dtype=torch.float32)
    assert len({digest_weights((flat.reshape(3, 4),)), digest_weights((flat.reshape(4, 3),)),
                digest_weights((flat.view(torch.int32).reshape(3, 4),))}) == 3  # same bytes each

