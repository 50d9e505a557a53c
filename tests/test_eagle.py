"""EAGLE heads: the engine's hidden states, the head's cached forwards against full ones, the
dynamic tree against a naive expansion, the rerank kernel against a naive reference, head files,
and the command line. Lossless decoding itself is checked in test_decode_greedy/_sampling."""
from __future__ import annotations

import json
import logging
import subprocess
import sys

import numpy as np
import pytest
import torch

from samctl.decode.drafters.eagle import EagleConfig, EagleDrafter, rerank
from samctl.decode.eagle_head import EagleHead, eagle_loss, target_features
from samctl.decode.engine.target import TargetModel
from samctl.decode.tree import DraftTree
from samctl.index.errors import UserError


def _head(model, seed: int = 0, vocab=None, scale: float = 4.0) -> EagleHead:
    torch.manual_seed(seed)
    head = EagleHead(model, vocab=vocab).eval()
    with torch.no_grad():  # scale > 1: peaked, varied draft distributions; < 1: near-uniform ones
        for p in head.parameters():
            p.mul_(scale)
    return head


@torch.inference_mode()
def test_verify_keeps_the_lm_head_input(tiny_llama):
    target = TargetModel(tiny_llama)
    target.capture_hidden(True)
    logits = target.prefill(torch.arange(3, 12), all_logits=True)
    torch.testing.assert_close(tiny_llama.lm_head(target.hidden), logits)
    tree = DraftTree(tokens=np.array([5, 6, 7]), parents=np.array([-1, 0, -1], dtype=np.int32))
    logits = target.verify(target.verify_input(4, tree), tree)
    torch.testing.assert_close(tiny_llama.lm_head(target.hidden), logits)
    target.keep(np.array([0, 1]))
    target.capture_hidden(False)
    target.verify(target.verify_input(4, DraftTree.empty()), DraftTree.empty())
    assert target.hidden is None


def _full(head: EagleHead, features: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    # features: [n, H] -> predicted [n, H] for pairs (features[i], tokens[i]) at positions 0..n-1
    ids = torch.tensor(tokens)[None]
    return head(features[None], ids, torch.arange(len(tokens))[None])[0]


@torch.inference_mode()
def test_catch_up_equals_one_full_forward(tiny_llama):
    head = _head(tiny_llama)
    drafter = EagleDrafter(head, EagleConfig(top_k=3, depth=2, max_nodes=8, min_prob=0.0))
    rng = np.random.default_rng(0)
    # seeded: an unseeded draw depended on which tests ran first
    feats = torch.randn(30, tiny_llama.config.hidden_size, generator=torch.Generator().manual_seed(0))
    ids = rng.integers(3, 96, 30).tolist()
    drafter.start(np.array(ids[:10]), None, hidden=feats[:10])
    n = 10  # committed tokens; ids[n] is t0
    for step in (3, 1, 5, 2):  # accepted runs of various lengths (committed = t0 + step - 1 drafts)
        root = drafter._catch_up(ids[n])
        # float32, cached steps against one forward: sums in another order differ by ~1e-5
        torch.testing.assert_close(root, _full(head, feats[:n], ids[1 : n + 1])[-1], atol=1e-4, rtol=1e-4)
        drafter._expand(root, 3)  # leaves draft entries in the head's cache; observe drops them
        drafter.observe(np.array(ids[n : n + step]), None, None, hidden=feats[n : n + step])
        n += step


@pytest.mark.parametrize("use_vocab", [False, True])
@torch.inference_mode()
def test_tree_scores_equal_naive_path_forwards(tiny_llama, use_vocab):
    vocab = torch.arange(0, 96, 2) if use_vocab else None  # a draft vocabulary of the even ids
    head = _head(tiny_llama, seed=1, vocab=vocab)
    k, depth = 3, 3
    drafter = EagleDrafter(head, EagleConfig(top_k=k, depth=depth, max_nodes=100, min_prob=0.0))
    H = tiny_llama.config.hidden_size
    torch.manual_seed(2)
    feats = torch.randn(8, H)
    ids = list(range(10, 18))
    t0 = 20
    drafter.start(np.array(ids), None, hidden=feats)
    root = drafter._catch_up(t0)
    tokens, scores, parents = (t.numpy() for t in drafter._expand(root, k))
    assert len(tokens) == k + depth * k * k
    if use_vocab:
        assert np.all(tokens % 2 == 0)
    # naive: each candidate's path re-run from scratch through the head, no cache, no tree mask
    for c in range(len(tokens)):
        path = [c]
        while parents[path[-1]] >= 0:
            path.append(int(parents[path[-1]]))
        path = path[::-1]
        seq_feats, seq_ids = feats, ids[1:] + [t0]
        score = 0.0
        for node in path:
            predicted = _full(head, seq_feats, seq_ids)[-1]
            logq = torch.log_softmax(head.logits(predicted).float(), -1)
            index = int(tokens[node]) // 2 if use_vocab else int(tokens[node])
            score += float(logq[index])
            seq_feats = torch.cat((seq_feats, predicted[None]))
            seq_ids = seq_ids + [int(tokens[node])]
        assert scores[c] == pytest.approx(score, rel=1e-5, abs=1e-4), (c, path)


def _naive_rerank(scores, parents, depths, scale, cost, max_nodes):
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    chosen, expected, values = [], 1.0, [1.0 / cost[0]]
    for i in order:
        if len(chosen) >= min(max_nodes, len(cost) - 1):
            break
        if parents[i] >= 0 and parents[i] not in chosen:
            continue
        chosen.append(i)
        expected += min(1.0, np.exp(scores[i]) * scale[min(depths[i], len(scale) - 1)])
        values.append(expected / cost[len(chosen)])
    best = int(np.argmax(values))  # first maximum, as the kernel (strictly greater to move)
    return sorted(chosen[:best])


def test_rerank_matches_naive_reference():
    rng = np.random.default_rng(0)
    for _ in range(300):
        c = int(rng.integers(1, 40))
        parents = np.array([-1 if i == 0 or rng.random() < 0.3 else int(rng.integers(0, i)) for i in range(c)],
                           dtype=np.int64)
        logq = -rng.exponential(1.0, c)
        logq[rng.random(c) < 0.1] = 0.0  # ties with the parent's score
        scores = np.zeros(c)
        depths = np.zeros(c, dtype=np.int64)
        for i in range(c):
            base, d = (0.0, 1) if parents[i] < 0 else (scores[parents[i]], depths[parents[i]] + 1)
            scores[i], depths[i] = base + logq[i], d
        scale = rng.uniform(0.2, 1.5, 33)
        cost = np.cumsum(np.concatenate(([1.0], rng.uniform(0.0, 0.3, int(rng.integers(1, 50))))))
        max_nodes = int(rng.integers(0, 45))
        keep, tree_parents = rerank(scores, parents, depths, scale, cost, max_nodes)
        assert keep.tolist() == _naive_rerank(scores, parents, depths, scale, cost, max_nodes)
        for j, i in enumerate(keep):  # parents point at kept nodes, earlier in the tree
            assert (tree_parents[j] == -1) == (parents[i] < 0)
            assert tree_parents[j] < j and (tree_parents[j] < 0 or keep[tree_parents[j]] == parents[i])


def test_cost_curve_sizes_the_tree(tiny_llama):
    head = _head(tiny_llama, scale=1.0)  # near-uniform q: no node's probability underflows
    flat = EagleDrafter(head, EagleConfig(top_k=4, depth=3, max_nodes=60, min_prob=0.0), np.ones(100))
    steep = EagleDrafter(head, EagleConfig(top_k=4, depth=3, max_nodes=60, min_prob=0.0), 1.0 + np.arange(100.0))
    feats = torch.randn(6, tiny_llama.config.hidden_size)
    sizes = []
    for drafter in (flat, steep):
        drafter.start(np.arange(3, 9), None, hidden=feats)
        sizes.append(len(drafter.propose(10)))
    assert sizes[0] == 4 + 3 * 16 and sizes[1] < 4  # free nodes: all of them; each node a full forward: few


def test_training_loss_learns_a_copy_target(tiny_llama):
    # A head trained on the target's own features gets better than chance at its next token.
    for p in tiny_llama.parameters():
        p.requires_grad_(False)
    rng = np.random.default_rng(0)
    seqs = [torch.from_numpy(np.tile(rng.integers(3, 96, 6), 6)) for _ in range(6)]
    data = [target_features(tiny_llama, s) for s in seqs]
    feats = torch.stack([f for f, _ in data])
    choices = torch.stack([c for _, c in data])
    tokens = torch.stack(seqs)
    weights = torch.ones(tokens.shape, dtype=torch.float32)
    torch.manual_seed(0)
    head = EagleHead(tiny_llama)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    _, before = eagle_loss(head, feats, tokens, choices, weights, noise=0.0)
    for _ in range(150):
        loss, _ = eagle_loss(head, feats, tokens, choices, weights)
        opt.zero_grad()
        loss.backward()
        opt.step()
    _, after = eagle_loss(head, feats, tokens, choices, weights, noise=0.0)
    assert after["regression"] < 0.5 * before["regression"]
    assert after["top1_hits"] / after["count"] > 0.5 > before["top1_hits"] / before["count"]


def test_head_file_roundtrip_and_refusal(tmp_path, model_dir):
    from samctl.heads import load_eagle_head, save_eagle_head
    from samctl.heads import model_fingerprint
    from samctl.models import load_engine

    engine = load_engine(str(model_dir), "cpu", "float32")
    head = _head(engine.model, vocab=torch.arange(0, engine.vocab_size, 3))
    fp = model_fingerprint(engine.model, engine.tokenizer)
    save_eagle_head(tmp_path / "h", head, fp, {"note": "test"}, dtype=torch.float32)
    loaded = load_eagle_head(tmp_path / "h", engine.model, fp)
    for name, t in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], t)
    with pytest.raises(UserError, match="trained for another model"):
        load_eagle_head(tmp_path / "h", engine.model, {**fp, "config": "0" * 16})
    meta = json.loads((tmp_path / "h" / "eagle.json").read_text())
    (tmp_path / "h" / "eagle.json").write_text(json.dumps({**meta, "version": 99}))
    with pytest.raises(UserError, match="format version"):
        load_eagle_head(tmp_path / "h", engine.model, fp)
    with pytest.raises(UserError, match="not an EAGLE head folder"):
        load_eagle_head(tmp_path, engine.model, fp)


def test_cli_generate_eagle_is_lossless(tmp_path, model_dir):
    from samctl.heads import save_eagle_head
    from samctl.heads import model_fingerprint
    from samctl.models import load_engine
    from samctl.plan import resolve_eagle_path

    engine = load_engine(str(model_dir), "cpu", "float32")
    save_eagle_head(tmp_path / "h", _head(engine.model), model_fingerprint(engine.model, engine.tokenizer), {})
    out = subprocess.run(
        [sys.executable, "-m", "samctl", "generate", "--model", str(model_dir), "--method", "sam+eagle",
         "--eagle-head", str(tmp_path / "h"), "--prompt", "def add(a, b):", "--max-new-tokens", "16",
         "--compare", "--compare-runs", "1", "--json", "--quiet", "--threads", "1"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["compare"]["identical"] is True and result["eagle_head"] == str(tmp_path / "h")
    with pytest.raises(UserError, match="eagle_head="):
        resolve_eagle_path("eagle", str(model_dir), None, [])


def test_embedded_head_loads_for_the_embedded_target_only(model_dir):
    from samctl.heads import load_eagle
    from samctl.models import load_engine
    from samctl.plan import DEFAULT_EAGLE_DIR, resolve_eagle_path

    if not DEFAULT_EAGLE_DIR.is_dir():
        pytest.skip("no embedded EAGLE head in this checkout")
    path = resolve_eagle_path("sam+eagle", None, None, [])
    assert path == str(DEFAULT_EAGLE_DIR) and resolve_eagle_path("pld", None, None, []) is None
    head = load_eagle(path, load_engine(None, "cpu", "float32"))
    assert head.vocab is None and head.hidden_size == 256
    with pytest.raises(UserError, match="trained for another model"):
        load_eagle(path, load_engine(str(model_dir), "cpu", "float32"))


def test_hf_takes_the_eagle_head_its_message_names(tmp_path, model_dir):
    """samctl.hf's error says `eagle_head=`, and make_generate takes it (issue 42, item 12): the
    output is plain greedy generate's; a method without a head refuses one."""
    from transformers import AutoModelForCausalLM

    import samctl.hf
    from samctl.heads import model_fingerprint, save_eagle_head
    from samctl.models import load_engine

    engine = load_engine(str(model_dir), "cpu", "float32")
    save_eagle_head(tmp_path / "h", _head(engine.model), model_fingerprint(engine.model, engine.tokenizer), {})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([engine.tokenizer.encode("def add(a, b):\n    return a + b\n")])
    kw = dict(attention_mask=torch.ones_like(ids), pad_token_id=0, do_sample=False, max_new_tokens=12)
    with pytest.raises(UserError, match="eagle_head="):
        model.generate(ids, custom_generate=samctl.hf.make_generate(method="eagle"), **kw)
    fast = samctl.hf.make_generate(method="eagle", eagle_head=tmp_path / "h")
    assert torch.equal(model.generate(ids, custom_generate=fast, **kw), model.generate(ids, **kw))
    with pytest.raises(UserError, match="does not use eagle_head=: drop it"):
        samctl.hf.make_generate(method="pld", eagle_head=tmp_path / "h")


def test_the_installed_head_is_announced_once(tmp_path, model_dir, caplog):
    from samctl.heads import model_fingerprint, save_eagle_head
    from samctl.models import load_engine
    from samctl.session import Session, SessionConfig

    engine = load_engine(str(model_dir), "cpu", "float32")
    (tmp_path / "m").symlink_to(model_dir, target_is_directory=True)
    save_eagle_head(tmp_path / "m.eagle", _head(engine.model), model_fingerprint(engine.model, engine.tokenizer), {})
    with caplog.at_level(logging.INFO, logger="samctl"):
        Session(SessionConfig(model=str(tmp_path / "m"), method="eagle", max_new_tokens=4))
    assert caplog.text.count("using the EAGLE head installed beside the model") == 1
