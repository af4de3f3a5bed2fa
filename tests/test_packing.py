"""Packed micro-batches (``optim.packing``): rows concatenated into one, positions restarting per row and
attention limited to each row, give the padded path's log-probs, entropies, values and gradients."""
import pytest
import torch

from agentrl.learner.batch import Sample, collate, micro_batches, turn_sample


def _rows(vocab: int, shapes, prefix=()) -> list[Sample]:
    g = torch.Generator().manual_seed(3)
    rows = []
    for p, k in shapes:
        prompt = list(prefix) + torch.randint(3, vocab, (p,), generator=g).tolist()
        gen = torch.randint(3, vocab, (k,), generator=g).tolist()
        rows.append(turn_sample(prompt, gen, [0.0] * k, 1.0))
    return rows


UNEVEN = ((40, 6), (5, 3), (17, 9), (2, 12), (60, 4))  # prompt and generated lengths, very uneven


def test_packed_micro_batches_count_real_tokens():
    rows = _rows(100, UNEVEN)
    batch = collate(rows, 0)
    lengths = batch.lengths
    parts = micro_batches(batch, 70, packed=True)
    assert sorted(i for p in parts for i in p) == list(range(len(rows)))
    for p in parts:
        assert len(p) == 1 or sum(lengths[i] for i in p) <= 70
    # the same budget in padded tokens needs more micro-batches (each pays for its longest row)
    assert len(parts) < len(micro_batches(batch, 70))


def test_packed_micro_batches_of_rows_that_run_padded_count_padded_tokens():
    """Rows alike after a long shared prefix run padded with the prefix once (``packs``), so the budget
    counts them as the padded layout does: the same micro-batches, no larger; uneven rows count real tokens."""
    from agentrl.learner.batch import group_rows

    alike = collate(_rows(100, ((4, 3), (5, 3), (3, 4), (6, 2)), prefix=range(10, 60)), 0)
    assert alike.lengths == [57, 58, 57, 58]
    assert micro_batches(alike, 173, packed=True) == micro_batches(alike, 173) == [[0, 2], [1, 3]]
    assert group_rows(alike.lengths, 173, packed=True) == [[0, 2, 1], [3]]  # no prefix known: real tokens
    uneven = collate(_rows(100, UNEVEN, prefix=range(10, 30)), 0)
    assert uneven.lengths == [66, 28, 46, 34, 84]
    # 4 rows packed: 174 real tokens (padded with the prefix: 20 + 4 x 46 = 204 positions, 264 padded)
    assert micro_batches(uneven, 200, packed=True) == [[1, 3, 2, 0], [4]]
    assert micro_batches(uneven, 200) == [[1, 3, 2], [0, 4]]


@pytest.mark.parametrize("critic,checkpointing", [("shared", False), ("separate", False), ("separate", True)])
def test_packed_forward_and_gradients_equal_the_padded_ones(tiny_model_dir, critic, checkpointing):
    """Checkpointed layers recompute their forward in backward: segment attention again (it reads the
    position ids the layer is called with), not causal attention over the whole packed row."""
    from agentrl.learner.engine import EngineConfig, TorchEngine

    eng = TorchEngine(tiny_model_dir, EngineConfig(value_head=True, critic=critic, token_budget=10_000,
                                                   gradient_checkpointing=checkpointing))
    if eng.value_head is not None:  # a value head at zero reads 0 everywhere: give it weights
        torch.nn.init.normal_(eng.value_head.v.weight, std=0.1)
    else:
        torch.nn.init.normal_(eng.critic.head.v.weight, std=0.1)
    mb = collate(_rows(eng.model.config.vocab_size, UNEVEN), eng.pad_id)
    results = {}
    for packing in (False, True):
        eng.cfg.packing = packing
        eng._train_mode(True)
        for p in eng.trainable_parameters():
            p.grad = None
        out = eng.forward(mb, 0.9, need_entropy=True, need_values=True)
        w = mb.loss_mask * torch.linspace(0.5, 1.5, mb.loss_mask.shape[1])
        values_loss = ((out["values"] - 0.3) ** 2 * mb.attention_mask[:, 1:]).sum()
        ((out["logp"] * w).sum() + 0.2 * (out["entropy"] * w).sum() + values_loss).backward()
        grads = {n: p.grad.clone() for n, p in zip(range(10**6), eng.trainable_parameters()) if p.grad is not None}
        results[packing] = out, grads
    (padded, gp), (packed, gk) = results[False], results[True]
    real = mb.attention_mask[:, 1:].bool()  # the padded path's values at padding are not read by any loss
    for key in ("logp", "entropy"):
        torch.testing.assert_close(packed[key], padded[key], rtol=1e-4, atol=1e-5, msg=key)
    torch.testing.assert_close(packed["values"][real], padded["values"][real], rtol=1e-4, atol=1e-5)
    assert gp.keys() == gk.keys() and len(gp) > 10
    for k in gp:
        torch.testing.assert_close(gk[k], gp[k], rtol=1e-3, atol=1e-5, msg=f"gradient {k}")


def test_a_packed_step_and_logprobs_equal_the_padded_ones(tiny_model_dir):
    """Through the engine's micro-batching: the whole batch's log-probs and one optimizer step's loss and
    gradient norm, with a budget that splits the batch differently packed and padded."""
    from agentrl.algos.losses import sft_loss
    from agentrl.learner.engine import EngineConfig, TorchEngine

    def loss(mb, out):
        return sft_loss(out["logp"], mb.loss_mask), {}

    got = {}
    for packing in (False, True):
        eng = TorchEngine(tiny_model_dir, EngineConfig(token_budget=120, packing=packing))
        batch = collate(_rows(eng.model.config.vocab_size, UNEVEN), eng.pad_id)
        logp = eng.logprobs(batch)
        stats = eng.step(batch, loss)
        got[packing] = logp, stats
    torch.testing.assert_close(got[True][0], got[False][0], rtol=1e-4, atol=1e-5)
    assert got[True][1]["micro_batches"] < got[False][1]["micro_batches"]
    assert got[True][1]["loss"] == pytest.approx(got[False][1]["loss"], rel=1e-5)
    assert got[True][1]["grad_norm"] == pytest.approx(got[False][1]["grad_norm"], rel=1e-4)


def test_rows_sharing_a_long_prefix_run_padded_with_the_prefix_once(tiny_model_dir):
    """The shared prompt-prefix pass computes fewer positions than packing when rows are alike after a
    long common prefix; packing wins on uneven rows. Either way the log-probs are the same."""
    from agentrl.learner.engine import EngineConfig, TorchEngine
    from agentrl.learner.hidden import packs

    eng = TorchEngine(tiny_model_dir, EngineConfig(packing=True))
    vocab = eng.model.config.vocab_size
    alike = collate(_rows(vocab, ((4, 3), (5, 3), (3, 4)), prefix=range(10, 60)), eng.pad_id)
    uneven = collate(_rows(vocab, UNEVEN), eng.pad_id)
    assert not packs(alike, True, True) and packs(alike, True, False) and packs(uneven, True, True)
    assert not packs(uneven, False, True)
    for mb in (alike, uneven):
        eng.cfg.packing = True
        a = eng.logprobs(mb)
        eng.cfg.packing = False
        torch.testing.assert_close(a, eng.logprobs(mb), rtol=1e-4, atol=1e-5)


def test_packing_is_a_schema_key():
    from agentrl.config_loader import load_config

    assert load_config("grpo", env="bandit", overrides=["optim.packing=true"]).optim.packing is True


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_packed_zero3_ranks_equal_the_padded_torch_engine(tiny_model_dir, tmp_path, monkeypatch):
    """2 ZeRO-3 ranks packing their own rows: the whole batch's log-probs and values, and one step's loss
    and gradient norms (policy and separate critic), as one padded process computes them."""
    from agentrl.learner.engine import TorchEngine
    from tests.ds_packing_worker import config, loss_fn
    from tests.ds_passes_worker import set_critic_head
    from tests.test_deepspeed import _torchrun

    _torchrun("ds_packing_worker.py", [tiny_model_dir, tmp_path], tmp_path, monkeypatch)
    got = [torch.load(tmp_path / f"packing-rank{r}.pt") for r in (0, 1)]
    eng = TorchEngine(tiny_model_dir, config(False))
    set_critic_head(eng.critic.head)
    b = collate(_rows(eng.model.config.vocab_size, UNEVEN * 2), eng.pad_id)
    logp, values = eng.logprobs(b, values=True)
    stats = eng.step(b, loss_fn, need_entropy=True, need_values=True)
    real = b.attention_mask[:, 1:].bool()
    for r in got:
        assert r["packed"] and max(r["packed"]) > 1, r["packed"]
        torch.testing.assert_close(r["logp"], logp, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(r["values"][real], values[real], rtol=1e-4, atol=1e-5)
        for key in ("loss", "grad_norm", "critic_grad_norm"):
            assert r["stats"][key] == pytest.approx(stats[key], rel=1e-4), key


@pytest.mark.extended  # 36 s (the profiled steps for peak memory); packed and chunked equality is tested above
@pytest.mark.slow
def test_bench_learner_compares_padded_and_packed(tiny_model_dir, tmp_path):
    """`agentrl bench learner --compare packing` writes tokens/s and peak memory of both layouts per shape."""
    import json

    from agentrl.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "learner", "--model", str(tiny_model_dir), "--compare", "packing", "--shapes",
                 "alfworld-window", "--rows", "3", "--pairs", "1", "--autocast", "none", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["shape"] == "alfworld-window" and row["tokens"] > 0 and row["speedup"] > 0
    assert set(row["tokens_per_s"]) == set(row["peak_mb"]) == {"padded", "packed"}
    assert all(v > 0 for v in row["peak_mb"].values())


def test_agent_batch_shapes_are_uneven_and_full_chat_rows_hold_every_turns_targets():
    from agentrl.commands.bench_learner import shape_batch

    full = shape_batch("alfworld-full", 500)
    window = shape_batch("alfworld-window", 500)
    assert max(len(s.ids) for s in full) > 2.5 * min(len(s.ids) for s in full)
    # full chat: several generated spans a row; window: one, at the end
    spans = lambda s: sum(1 for a, b in zip([0] + s.loss_mask, s.loss_mask) if b and not a)  # noqa: E731
    assert max(spans(s) for s in full) > 5 and {spans(s) for s in window} == {1}
    assert all(s.loss_mask[-1] == 1 for s in window)


def _per_row_hidden(decoder, ids_rows):
    """Each sequence alone through the decoder: what attention within each sequence must give."""
    return [decoder(input_ids=torch.tensor([ids]), use_cache=False).last_hidden_state[0] for ids in ids_rows]


def _packed_rows(seqs_per_row):
    """(B, W) ids and positions of rows that each hold several sequences (positions restarting at 0), the
    rows padded at the end by one more sequence of their own."""
    width = max(sum(map(len, seqs)) for seqs in seqs_per_row)
    ids, pos = [], []
    for seqs in seqs_per_row:
        flat = [t for s in seqs for t in s]
        p = [i for s in seqs for i in range(len(s))]
        pad = width - len(flat)
        ids.append(flat + [3] * pad)
        pos.append(p + list(range(pad)))
    return torch.tensor(ids), torch.tensor(pos)


def test_transformers_keeps_each_sequence_of_each_packed_row_apart_under_sdpa(tiny_model_dir):
    """Several packed rows at once (bins): transformers (``masking_utils.find_packed_sequence_indices``) reads
    each row's position restarts on its own and builds a dense block-diagonal mask per row, so each sequence
    gets what it gets alone (with no cache: transformers looks for restarts only then). That mask is what makes
    one long packed row cost L^2 scores."""
    from agentrl.learner.models import load_model

    model = load_model(tiny_model_dir)
    assert model.config._attn_implementation == "sdpa"
    g = torch.Generator().manual_seed(0)
    seqs = [[torch.randint(3, 100, (n,), generator=g).tolist() for n in row] for row in ((9, 4, 6), (12, 5))]
    ids, pos = _packed_rows(seqs)
    with torch.no_grad():
        out = model.get_decoder()(input_ids=ids, attention_mask=None, position_ids=pos,
                                     use_cache=False).last_hidden_state
        for r, row in enumerate(seqs):
            alone = torch.cat(_per_row_hidden(model.get_decoder(), row))
            torch.testing.assert_close(out[r, :len(alone)], alone, rtol=1e-4, atol=1e-5)


def test_segment_attention_runs_each_sequence_alone_without_a_mask(tiny_model_dir, monkeypatch):
    """``segments.use``: the packed row's attention runs causally on each sequence's slice (no mask built),
    for one packed row and for several at once, with the same hidden states as each sequence alone."""
    import transformers.integrations.sdpa_attention as sa
    import transformers.masking_utils as mu

    from agentrl.learner import segments
    from agentrl.learner.models import load_model

    model = load_model(tiny_model_dir)
    decoder = model.get_decoder()
    assert segments.use(decoder) and model.config._attn_implementation == segments.SEGMENTS
    calls = []
    real_sdpa = sa.sdpa_attention_forward
    monkeypatch.setattr(sa, "sdpa_attention_forward",
                        lambda m, q, k, v, mask, *a, **kw: calls.append((q.shape[0], q.shape[2], mask is None))
                        or real_sdpa(m, q, k, v, mask, *a, **kw))
    monkeypatch.setattr(mu, "sdpa_mask", lambda **kw: pytest.fail("a mask was built for a packed row"))
    reads = []  # the row's bounds are read from the device once a forward, not once a layer (a CUDA sync each)
    real_bounds = segments.sequence_bounds
    monkeypatch.setattr(segments, "sequence_bounds", lambda pos: reads.append(1) or real_bounds(pos))
    g = torch.Generator().manual_seed(1)
    seqs = [[torch.randint(3, 100, (n,), generator=g).tolist() for n in row] for row in ((9, 4, 6), (12, 5))]
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        for rows in (seqs[:1], seqs):
            calls.clear()
            reads.clear()
            ids, pos = _packed_rows(rows)
            out = decoder(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=pos,
                              use_cache=False).last_hidden_state
            assert len(reads) == 1 and layers > 1
            pieces = [(1, len(s), True) for row in rows for s in row]
            pad = [ids.shape[1] - sum(map(len, row)) for row in rows]
            pieces += [(1, n, True) for n in pad if n]  # a row's padding: a sequence of its own
            assert sorted(calls) == sorted(pieces * layers)
            for r, row in enumerate(rows):
                alone = torch.cat(_per_row_hidden(decoder, row))
                torch.testing.assert_close(out[r, :len(alone)], alone, rtol=1e-4, atol=1e-5)


def test_segment_attention_leaves_padded_and_unpacked_passes_as_sdpa_runs_them(tiny_model_dir):
    """After ``segments.use`` a padded batch (its mask built as before) and a row of one sequence give what
    transformers' own SDPA gives; a model it cannot serve exactly is left as it is."""
    import copy

    from agentrl.learner import segments
    from agentrl.learner.models import load_model

    plain, switched = load_model(tiny_model_dir), load_model(tiny_model_dir)
    segments.use(switched)
    mb = collate(_rows(plain.config.vocab_size, UNEVEN), 0)
    with torch.no_grad():
        for m in (plain, switched):
            m.eval()
        a = plain(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        b = switched(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        real = mb.attention_mask.bool()
        torch.testing.assert_close(b[real], a[real])
        one = mb.input_ids[:1, :10]
        torch.testing.assert_close(switched(input_ids=one).logits, plain(input_ids=one).logits)
    for change in (dict(sliding_window=64), dict(layer_types=["sliding_attention", "full_attention"] * 2),
                   dict(_attn_implementation="eager")):
        cfg = copy.deepcopy(plain.config)
        for k, v in change.items():
            setattr(cfg, k, v)
        impl = cfg._attn_implementation
        assert not segments.use(type("M", (), {"config": cfg})()), change
        assert cfg._attn_implementation == impl


def test_the_engine_runs_padded_where_a_packed_row_would_need_a_dense_mask(tiny_model_dir, capsys):
    """optim.packing is the default: a model whose packed rows would get transformers' dense mask over the
    whole row (eager attention here; a sliding window alike) runs padded, said in a note."""
    from agentrl.learner.engine import EngineConfig, TorchEngine

    assert TorchEngine(tiny_model_dir, EngineConfig(packing=True)).cfg.packing
    eager = tiny_model_dir.parent / "tiny-eager"
    if not eager.exists():
        import json
        import shutil

        shutil.copytree(tiny_model_dir, eager)
        cfg = json.loads((eager / "config.json").read_text())
        (eager / "config.json").write_text(json.dumps(dict(cfg, attn_implementation="eager")))
    engine = TorchEngine(eager, EngineConfig(packing=True))
    assert engine.model.config._attn_implementation == "eager" and not engine.cfg.packing
    assert "optim.packing runs padded for this model" in capsys.readouterr().out
