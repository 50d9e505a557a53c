"""SpecDec++: the acceptance head, its stop rule and bounds, its training data and loss, its
file format (refused with another model pair), and the training tool end to end."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from samctl.decode.acceptance_head import (AcceptanceHead, Examples, HeadConfig, TrainConfig, collect_examples,
                                    evaluate_head, train_head, weighted_bce)
from samctl.decode.draft_model import DraftModel
from samctl.decode.drafters.draft import AdaptiveLength, DraftModelDrafter, SpecDecConfig
from samctl.index.errors import UserError
from samctl.heads import CONFIG, load_head, save_head
from tests.conftest import _tiny
from tests.test_draft_model import save_model_with_tokenizer_of

ROOT = Path(__file__).resolve().parent.parent


def constant_head(hidden_size: int, p_accept: float, blocks: int = 3) -> AcceptanceHead:
    """A head that predicts p_accept whatever it reads: zero output weights, biased logits."""
    head = AcceptanceHead(HeadConfig(hidden_size, blocks))
    with torch.no_grad():
        head.out.weight.zero_()
        head.out.bias.copy_(torch.tensor([0.0, math.log(p_accept / (1 - p_accept))]))
    return head.eval()


def test_shared_blocks_store_one_block():
    shared = AcceptanceHead(HeadConfig(16, num_blocks=3, shared_blocks=True))
    independent = AcceptanceHead(HeadConfig(16, num_blocks=3, shared_blocks=False))
    block = 16 * 16 + 16
    assert sum(p.numel() for p in shared.parameters()) == block + 16 * 2 + 2
    assert sum(p.numel() for p in independent.parameters()) == 3 * block + 16 * 2 + 2
    x = torch.randn(5, 16)
    # Shared: the one block applied three times, as the reference's [ResBlock(h)] * L.
    expected = x
    for _ in range(3):
        expected = expected + torch.nn.functional.silu(shared.blocks[0].linear(expected))
    torch.testing.assert_close(shared(x), shared.out(expected))
    p = shared.accept_prob(x.to(torch.float64))
    assert p.shape == (5,) and p.dtype == torch.float32 and bool(((p > 0) & (p < 1)).all())


def test_weighted_bce_matches_the_formula():
    torch.manual_seed(0)
    logits, labels, w = torch.randn(7, 2), torch.rand(7), 6.0
    log_p = torch.log_softmax(logits, -1)
    num = sum(-(w * (1 - y) * lp[0] + y * lp[1]) for y, lp in zip(labels, log_p))
    den = w * (1 - labels).sum() + labels.sum()
    torch.testing.assert_close(weighted_bce(logits, labels, w), num / den)


def expected_length(p: float, threshold: float, lo: int, hi: int) -> int:
    """The stop rule with a constant P(accept) = p: y_1's state is t0 (P = 1), so after drafting
    y_k the predicted P(some rejection) is 1 - p^(k-1)."""
    for k in range(1, hi + 1):
        if k >= hi or (k >= lo and 1 - p ** (k - 1) > threshold):
            return k
    return hi


@pytest.mark.parametrize("p,threshold,bounds", [
    (0.999, 0.3, (2, 20)), (0.9, 0.3, (2, 20)), (0.6, 0.3, (2, 20)), (0.05, 0.3, (2, 20)),
    (0.05, 0.3, (5, 9)), (0.8, 0.7, (1, 20)), (0.5, 0.0, (1, 6)), (0.5, 1.0, (3, 3)),
])
def test_adaptive_length_follows_the_stop_rule(tiny_llama, p, threshold, bounds):
    draft = DraftModel(tiny_llama)
    config = SpecDecConfig(stop_threshold=threshold, min_draft=bounds[0], max_draft=bounds[1])
    drafter = DraftModelDrafter(draft, AdaptiveLength(constant_head(draft.hidden_size, p), config), name="specdec++")
    prompt = np.arange(3, 23, dtype=np.int64)
    drafter.start(prompt, torch.zeros(0))
    lengths = set()
    for t0 in (5, 9, 40):
        tree = drafter.propose(t0)
        lengths.add(len(tree))
        drafter.observe(np.array([t0]), torch.zeros(0), torch.zeros(0))  # nothing accepted
    assert lengths == {expected_length(p, threshold, *bounds)}


def test_random_head_lengths_stay_in_bounds_and_stop_at_eos(tiny_llama):
    draft = DraftModel(tiny_llama)
    torch.manual_seed(1)
    head = AcceptanceHead(HeadConfig(draft.hidden_size, 3))
    with torch.no_grad():
        head.out.weight.mul_(40.0)  # spread the predictions so lengths vary
    config = SpecDecConfig(stop_threshold=0.3, min_draft=2, max_draft=7)
    drafter = DraftModelDrafter(draft, AdaptiveLength(head, config))
    rng = np.random.default_rng(0)
    drafter.start(rng.integers(3, 96, 12), torch.zeros(0))
    lengths = []
    for t0 in rng.integers(3, 96, 40):
        lengths.append(len(drafter.propose(int(t0))))
        drafter.observe(np.array([t0]), torch.zeros(0), torch.zeros(0))
    assert min(lengths) >= 2 and max(lengths) <= 7 and len(set(lengths)) > 1, lengths
    # A drafted EOS ends the chain (it is the last draft token).
    always = DraftModelDrafter(draft, AdaptiveLength(constant_head(draft.hidden_size, 0.999), SpecDecConfig(0.3, 1, 20)))
    always.start(np.arange(3, 15), torch.zeros(0))
    chain = always.propose(7).tokens.tolist()
    eos = chain[2]
    first = chain.index(eos)
    stopping = DraftModelDrafter(draft, AdaptiveLength(constant_head(draft.hidden_size, 0.999), SpecDecConfig(0.3, 1, 20)),
                                 eos_token_ids=(eos,))
    stopping.start(np.arange(3, 15), torch.zeros(0))
    assert stopping.propose(7).tokens.tolist() == chain[: first + 1]


def test_collect_examples_labels_and_mixing():
    target = _tiny("llama", vocab=96, seed=0).eval()
    prompt, response = list(range(3, 13)), list(range(20, 60))
    generator = torch.Generator().manual_seed(0)
    same = collect_examples(target, target, prompt, response, 0.0, generator)
    assert same.features.shape == (40, 32) and len(same) == 40
    torch.testing.assert_close(same.labels, torch.ones(40), atol=1e-4, rtol=0)  # p == q: always accepted
    draft = _tiny("llama", vocab=96, seed=1).eval()
    mixed = collect_examples(target, draft, prompt, response, 0.5, generator)
    assert 5 < len(mixed) < 35 and bool(((mixed.labels >= 0) & (mixed.labels <= 1)).all())
    assert float(mixed.labels.min()) < 0.9  # a different draft is sometimes rejected
    greedy = collect_examples(target, draft, prompt, response, 0.0, generator, greedy=True)
    p_top = target(input_ids=torch.tensor([prompt + response])).logits[0, 9:49].argmax(-1)
    q_top = draft(input_ids=torch.tensor([prompt + response])).logits[0, 9:49].argmax(-1)
    torch.testing.assert_close(greedy.labels, (p_top == q_top).float())


def test_training_lowers_heldout_loss_on_learnable_labels():
    """Labels that depend on the features: the trained head beats the untrained one and the best
    constant on held-out examples; validation keeps the best pass."""
    torch.manual_seed(0)
    features = torch.randn(1200, 16)
    labels = torch.sigmoid(3 * features[:, 0] - 1)
    train, valid, heldout = (Examples(features[a:b], labels[a:b]) for a, b in ((0, 800), (800, 1000), (1000, 1200)))
    head = AcceptanceHead(HeadConfig(16, 3))
    before = evaluate_head(head, heldout, 6.0)
    train_head(head, train, TrainConfig(steps=400, batch_size=128, lr=3e-3), valid)
    p = float(train.labels.sum() / (train.labels.sum() + 6 * (1 - train.labels).sum()))
    constant = float(weighted_bce(torch.log(torch.tensor([[1 - p, p]])).expand(200, 2), heldout.labels, 6.0))
    after = evaluate_head(head, heldout, 6.0)
    assert after < constant < before or after < before < constant, (before, constant, after)
    assert after < 0.9 * min(before, constant)


FP_T = {"config": "t" * 16, "tokenizer": "k" * 16, "weights": "w" * 16}
FP_D = {"config": "d" * 16, "tokenizer": "k" * 16, "weights": "v" * 16}


def test_head_file_roundtrip_and_refusals(tmp_path, caplog):
    head = AcceptanceHead(HeadConfig(8, 2, shared_blocks=False))
    save_head(tmp_path / "h", head, FP_T, FP_D, {"note": "test"})
    loaded = load_head(tmp_path / "h", FP_T, FP_D, torch.device("cpu"))
    x = torch.randn(3, 8)
    torch.testing.assert_close(loaded(x), head(x))
    load_head(tmp_path / "h", FP_T, {**FP_D, "weights": "x" * 16}, torch.device("cpu"))
    assert "other weights of this draft" in caplog.text  # a warning: the command line prints it even --quiet
    with pytest.raises(UserError, match="another draft"):
        load_head(tmp_path / "h", FP_T, FP_T, torch.device("cpu"))
    with pytest.raises(UserError, match="another target"):
        load_head(tmp_path / "h", FP_D, FP_D, torch.device("cpu"))
    with pytest.raises(UserError, match="not an acceptance head folder"):
        load_head(tmp_path, FP_T, FP_D, torch.device("cpu"))
    meta = json.loads((tmp_path / "h" / CONFIG).read_text())
    for change in ({"version": 99}, {"num_blocks": "3"}, {"shared_blocks": True}, {"format": "x"}):
        (tmp_path / "h" / CONFIG).write_text(json.dumps({**meta, **change}))
        with pytest.raises(UserError):
            load_head(tmp_path / "h", FP_T, FP_D, torch.device("cpu"))
    (tmp_path / "h" / CONFIG).write_text("{not json")
    with pytest.raises(UserError, match="cannot read"):
        load_head(tmp_path / "h", FP_T, FP_D, torch.device("cpu"))


@pytest.mark.slow
def test_training_tool_end_to_end(model_dir, tmp_path):
    from samctl.heads import load_acc_head
    from samctl.models import load_draft, load_engine

    draft_dir = tmp_path / "draft"
    save_model_with_tokenizer_of(model_dir, draft_dir)
    rows = [{"instruction": f"Write function {i} that adds {i} to a number.", "input": "def add(a, b):" if i % 2 else ""}
            for i in range(30)]
    (tmp_path / "prompts.json").write_text(json.dumps(rows))
    out = tmp_path / "head"
    proc = subprocess.run([sys.executable, "-m", "samctl", "train", "acc-head", "--target", str(model_dir),
                           "--draft", str(draft_dir), "--prompts", str(tmp_path / "prompts.json"), "--num-prompts", "30",
                           "--heldout", "0.2", "--max-new-tokens", "16", "--steps", "300", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["examples"]["train"] > 100 and report["examples"]["heldout"] > 20
    assert report["heldout_loss"]["trained"] < report["heldout_loss"]["untrained"], report["heldout_loss"]
    engine = load_engine(str(model_dir), "cpu", "float32")
    draft = load_draft(str(draft_dir), engine)
    head = load_acc_head(str(out), engine, draft)
    assert head.config == HeadConfig(draft.hidden_size, 3, True)
    # The same files with the roles swapped are another pair: refused.
    swapped = load_engine(str(draft_dir), "cpu", "float32")
    with pytest.raises(UserError, match="another target"):
        load_acc_head(str(out), swapped, load_draft(str(model_dir), swapped))
    cli = subprocess.run([sys.executable, "-m", "samctl", "generate", "--model", str(model_dir), "--draft-model",
                          str(draft_dir), "--method", "specdec++", "--acc-head", str(out), "--bounds", "1", "6",
                          "--prompt", "def add(a, b):\n", "--max-new-tokens", "24", "--json", "--compare"],
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    result = json.loads(cli.stdout)
    assert result["compare"]["identical"] is True and result["acc_head"] == str(out)
    assert result["config"]["method"]["specdec"] == {"stop_threshold": 0.3, "min_draft": 1, "max_draft": 6}
