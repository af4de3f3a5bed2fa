"""Run by tests/test_deepspeed.py under `torchrun --nproc_per_node=2` with DS_ACCELERATOR=cpu: the passes
without gradient (KL reference, critic values, the proximal log-probs) on 2 ZeRO-3 ranks. Each rank saves
what it got and how many rows each pass ran on it."""
import os
import sys

import torch

import agentrl.learner.deepspeed_engine as dse
import agentrl.learner.engine as te
from agentrl.learner.batch import collate
from agentrl.learner.engine import EngineConfig

ROWS: list[int] = []  # rows of every policy/reference forward on this rank


def samples():
    from tests.test_learner import _samples

    return _samples(n=8, seed=5)


def data(pad_id):
    """The whole batch, as one process collates it (the torch engine's reference run)."""
    return collate(samples(), pad_id=pad_id)


def config():
    return EngineConfig(value_head=True, critic="separate", token_budget=100_000)


def set_critic_head(head):
    """A non-zero value head (it starts at zero), the same in the torch engine and here."""
    with torch.no_grad():
        head.v.weight.copy_(torch.linspace(-0.5, 0.5, head.v.weight.numel()).view_as(head.v.weight))
        head.v.bias.fill_(0.25)


def _counted(forward_batch):
    def counted(model, value_head, mb, *args, **kwargs):
        ROWS.append(len(mb))
        return forward_batch(model, value_head, mb, *args, **kwargs)
    return counted


def main(model_dir, out_dir):
    import deepspeed

    for mod in (te, dse):  # count rows where both engines' reference and policy passes go through
        mod.forward_batch = _counted(mod.forward_batch)
    eng = dse.DeepSpeedEngine(model_dir, config())
    head = eng.critic_ds.module.head
    with deepspeed.zero.GatheredParameters(list(head.parameters()), modifier_rank=0):
        if eng.rank == 0:
            set_critic_head(head)
    critic_rows: list[int] = []
    eng.critic_ds.module.register_forward_pre_hook(lambda m, args: critic_rows.append(len(args[0])))
    eng.set_reference(model_dir)
    from tests.test_token_batch import rank_batch

    b = rank_batch(samples(), eng.pad_id, eng.rank, eng.world)  # the other rank's rows unreadable
    out, rows = {}, {}
    for name, fn in (("ref", lambda: eng.ref_logprobs(b)), ("prox", lambda: eng.logprobs(b)),
                     ("values", lambda: eng.logprobs(b, values=True)[1])):
        ROWS.clear()
        critic_rows.clear()
        out[name] = fn()
        rows[name] = sum(critic_rows) if name == "values" else sum(ROWS)
    ref = list(getattr(eng.reference, "module", getattr(eng.reference, "model", None)).parameters())
    out.update(rows=rows, own=eng.local_rows(b), rank=eng.rank, ref_dtype=str(ref[0].dtype),
               ref_partition=sum(getattr(p, "ds_tensor", p).numel() for p in ref),
               ref_full=sum(getattr(p, "ds_numel", p.numel()) for p in ref))
    torch.save(out, os.path.join(out_dir, f"passes-rank{eng.rank}.pt"))
    eng.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see ds_zero3_worker.py: static destructors rarely abort a rank under load
