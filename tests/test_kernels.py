"""Device fast paths against the portable reference they replace."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from inferlab.engine.kernels import PackedLinear, cpu_fp32_packing_available, select_kernels

from conftest import tiny_engine

needs_onednn = pytest.mark.skipif(not cpu_fp32_packing_available(torch.device("cpu"), torch.float32),
                                  reason="this torch build has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 96), (1, 1, 96), (3, 7, 96)])
def test_packed_linear_equals_f_linear(bias, shape):
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias)
    x = torch.randn(shape)
    assert torch.allclose(PackedLinear(linear)(x), F.linear(x, linear.weight, linear.bias), atol=1e-5)


@needs_onednn
def test_engine_with_packed_kernels_matches_reference(tiny_tokenizer):
    reference = tiny_engine(tiny_tokenizer)
    fast = tiny_engine(tiny_tokenizer)
    swapped = select_kernels(fast.model, torch.device("cpu"), torch.float32)
    assert "output" in swapped and "layers.0.attention.wqkv" in swapped and len(swapped) == 1 + 4 * 2
    prompt = list(range(20, 52))
    ref_logits, ref_seq = reference.prefill(prompt)
    fast_logits, fast_seq = fast.prefill(prompt)
    for _ in range(20):
        assert torch.allclose(ref_logits, fast_logits, atol=1e-4)
        token = int(ref_logits.argmax())
        ref_logits, fast_logits = reference.decode_step(token, ref_seq), fast.decode_step(token, fast_seq)
    ref_seq.release()
    fast_seq.release()


def test_other_devices_and_dtypes_keep_f_linear(tiny_tokenizer):
    model = tiny_engine(tiny_tokenizer).model
    assert select_kernels(model, torch.device("cpu"), torch.bfloat16) == []
    assert select_kernels(model, torch.device("cuda"), torch.float32) == []
    assert all(type(m) is not PackedLinear for m in model.modules())
