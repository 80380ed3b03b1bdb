"""What a newcomer's first run prints: the README's question at the defaults, on every kernel build this CPU runs.

The default precision serves the embedded GGUF's own 4-bit blocks through the fused C++ step. Its logits must
reach greedy choice in fp32: rounded to bf16 (a spacing of 0.125 near 25), fp32's margin of 0.08 between "The" and
"L" on this question became a tie, and the answer turned into "L'Étoile, la Marseillaise, ..." on AVX2 CPUs.
"""

import subprocess
import sys

import pytest
import torch

from inferlab import load_engine

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
CLEAR_MARGIN = 0.05  # fp32's top-two gap beyond which the 4-bit path's own rounding may not swap the two


def test_cli_at_the_defaults_answers_paris(isa):
    result = subprocess.run(
        [sys.executable, "-m", "inferlab.generate", f"prompt={QUESTION}", f"device.isa={isa}", "max_new_tokens=24"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout, result.stdout


@torch.inference_mode()
def teacher_forced(engine, ids: list[int], prompt: int) -> torch.Tensor:
    """The logits before each of ids[prompt:], the prompt prefilled and the rest decoded a step each, as served."""
    logits, sequence = engine.prefill(ids[:prompt], reserve_tokens=len(ids) - prompt)
    try:
        rows = [logits.reshape(-1)]
        rows += [engine.decode_step(token, sequence).reshape(-1) for token in ids[prompt:-1]]
    finally:
        sequence.release()
    return torch.stack(rows)


@pytest.fixture(scope="module")
def fp32_answer() -> tuple[list[int], int, torch.Tensor]:
    """The chat prompt and fp32's greedy answer to it, with fp32's teacher-forced logits over the answer."""
    engine = load_engine(precision="fp32")
    try:
        prompt = engine.encode_prompt(QUESTION, chat=True)
        ids = prompt + list(engine.generate(prompt, max_new_tokens=24, temperature=0.0).token_ids)
        return ids, len(prompt), teacher_forced(engine, ids, len(prompt))
    finally:
        engine.close()


def test_default_path_picks_fp32s_token_wherever_fp32_is_clear(isa, fp32_answer):
    ids, prompt, reference = fp32_answer
    engine = load_engine(**{"device.isa": isa})  # every other setting at its default
    try:
        logits = teacher_forced(engine, ids, prompt)
    finally:
        engine.close()
    top2 = reference.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > CLEAR_MARGIN
    assert clear.any()
    picked, wanted = logits.argmax(-1), reference.argmax(-1)
    assert torch.equal(picked[clear], wanted[clear]), f"positions {(picked != wanted).nonzero().flatten().tolist()}"
    assert logits.dtype == torch.float32
