"""CUDA/NCCL checks, run as a script by tests/test_cuda.py (skipped without a GPU).

A world of one NCCL rank: a GPT built on the CPU is sharded onto the GPU and trained next
to an unsharded copy; the losses must agree, and a bf16 run must train.
"""

import copy
import sys

import torch

import shardwise as sw
from shardwise.models import GPT, GPTConfig


def main() -> int:
    sw.init_distributed()
    import torch.distributed as dist

    assert dist.get_backend() == "nccl", dist.get_backend()
    cfg = GPTConfig(vocab_size=512, seq_len=64, n_layer=3, n_head=4, d_model=128)
    torch.manual_seed(0)
    base = GPT(cfg)
    ref = copy.deepcopy(base).cuda()
    ours = sw.shard(copy.deepcopy(base))  # built on CPU: shard() moves it to the GPU
    assert all(p.is_cuda for p in ours.parameters())
    mp = sw.shard(copy.deepcopy(base), mixed_precision=sw.MixedPrecision(torch.bfloat16))
    models = (ref, ours, mp)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    g = torch.Generator().manual_seed(1)
    worst, worst_mp = 0.0, 0.0
    for step in range(8):
        x = torch.randint(0, 512, (4, 64), generator=g).cuda()
        losses = []
        for m, o in zip(models, opts):
            loss = m(x, x.roll(-1, 1))
            loss.backward()
            if m is not ref:
                sw.clip_grad_norm_(m, 10.0)
            else:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 10.0)
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        worst = max(worst, abs(losses[1] - losses[0]) / losses[0])
        worst_mp = max(worst_mp, abs(losses[2] - losses[0]) / losses[0])
        print(f"step {step}: ref {losses[0]:.6f} shardwise {losses[1]:.6f} bf16 {losses[2]:.6f}")
    sd = sw.full_state_dict(ours)
    diff = max((sd[k].float() - v.float().cpu()).abs().max().item()
               for k, v in ref.state_dict().items())
    print(f"max relative loss difference fp32 {worst:.2e}, bf16 {worst_mp:.2e}; "
          f"max state difference {diff:.2e}")
    print(f"peak CUDA memory {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")
    assert worst < 1e-5 and diff < 1e-4 and worst_mp < 5e-2
    sw.check_consistency(ours)

    # Checkpoint round trip on the GPU (CUDA RNG state included), then gathered().
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        sw.save_checkpoint(f"{tmp}/ck", ours, opts[1], extra={"step": 8})
        torch.manual_seed(5)
        other = sw.shard(GPT(cfg))
        other_opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
        assert sw.load_checkpoint(f"{tmp}/ck", other, other_opt) == {"step": 8}
        back = sw.full_state_dict(other)
        assert all(torch.equal(back[k], v) for k, v in sd.items())
    with sw.gathered(other.lm_head, modifier_rank=0):
        with torch.no_grad():
            other.lm_head.weight.mul_(0)
    assert sw.full_state_dict(other)["tok_emb.weight"].abs().max().item() == 0

    # sharded_init under NCCL equals build-then-shard.
    torch.manual_seed(3)
    built = sw.shard(GPT(cfg))
    torch.manual_seed(3)
    with sw.sharded_init():
        lazy = GPT(cfg)
    lazy = sw.shard(lazy)
    a, b = sw.full_state_dict(built), sw.full_state_dict(lazy)
    assert all(torch.equal(a[k], b[k]) for k in a)
    print("checkpoint, gathered and sharded_init on CUDA: ok")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
