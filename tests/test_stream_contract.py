"""The stream contract of communication: a collective completes through its
event, never when its call returned (NCCL returns once a collective is
queued). With ZEROCORE_LATE_COMPLETION every queue's collectives complete
late, reading their inputs and writing their outputs only after a random
delay, so a reader that does not wait for the event gets stale data: the
engine trains the same under it. The control plane (agreements, the step's
exchange with the order fingerprint, stage 3's rounds) runs on host groups
beside the data group."""
import os
import threading

import pytest
import torch
import torch.distributed as dist

import zerocore
from dist_harness import run_ranks
from models import assert_state_close, engine_train, make, reference_train
from zerocore import _native
from zerocore.comm import communicator as zcomm
from zerocore.comm.process_group import ProcessGroupTransport

STEPS, ACCUM = 3, 2
HP = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.99))
CONFIGS = [dict(stage=0), dict(stage=1, bucket_bytes=256), dict(stage=2, bucket_bytes=256),
           dict(stage=2, bucket_bytes=256, offload_optimizer="cpu"), dict(stage=3, bucket_bytes=256),
           dict(stage=3, bucket_bytes=256, prefetch_bytes=0)]


def _train(rank, world, config):
    model = make()
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), **HP), zerocore.Config(**config))
    state = engine_train(engine, rank, world, STEPS, ACCUM)
    engine.close()
    return state


def _train_both_ways(rank, world, seed):
    """Every config trained with collectives that complete on return (gloo
    waited for) and again with late ones."""
    out = {}
    for i, config in enumerate(CONFIGS):
        os.environ.pop("ZEROCORE_LATE_COMPLETION", None)
        on_return = _train(rank, world, config)
        os.environ["ZEROCORE_LATE_COMPLETION"] = str(seed + i)
        out[i] = (on_return, _train(rank, world, config))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_late_completion_trains_the_same(world, gen):
    seed = int(torch.randint(0, 1 << 30, (1,), generator=gen))
    results = run_ranks(_train_both_ways, world, seed, timeout=300)
    model = make()
    ref = reference_train(model, torch.optim.AdamW(model.parameters(), **HP), STEPS, ACCUM, world)
    for i, config in enumerate(CONFIGS):
        for rank in range(world):
            on_return, late = results[rank][i]
            assert_state_close(late, ref, rtol=1e-5, atol=1e-6, what=f"late, rank {rank} {config}")
            for name in on_return:  # the same collectives in the same order: the same bits
                assert torch.equal(late[name], on_return[name]), f"rank {rank} {config} {name}"


def _record_keys(rank, world, stage):
    """The engine's collectives, by the process group they ran on."""
    calls = []
    methods = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
    originals = {m: getattr(ProcessGroupTransport, m) for m in methods}

    def recording(method):
        def call(self, key, *args):
            calls.append((self.group, tuple(key)))
            return originals[method](self, key, *args)
        return call

    for m in methods:
        setattr(ProcessGroupTransport, m, recording(m))
    model = make()
    engine = zerocore.wrap(model, torch.optim.AdamW(model.parameters(), **HP),
                           zerocore.Config(stage=stage, bucket_bytes=256))
    engine_train(engine, rank, world, 2, 1)
    groups = {"data": engine.comm.group, "control": engine.control.group,
              "reductions": engine.reduce_comm.group if engine.reduce_comm else None,
              "rounds": engine.rounds_comm.group if stage == 3 else None}
    backends = {name: dist.get_backend(g) for name, g in groups.items() if g is not None}
    engine.close()
    by_group = {name: [key for g, key in calls if g is groups[name]] for name in groups}
    elsewhere = [key for g, key in calls if all(g is not mine for mine in groups.values())]
    return backends, by_group, elsewhere


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_control_traffic_goes_on_the_control_group(stage):
    Kind, Purpose = zcomm.CollectiveKind, zcomm.ControlPurpose
    for backends, by_group, elsewhere in run_ranks(_record_keys, 2, stage, timeout=120):
        assert backends["control"] == "gloo" and backends.get("rounds", "gloo") == "gloo"
        assert elsewhere == []
        control = by_group["control"]
        assert all(group == zcomm._CONTROL for _, group, _, _ in control)
        gathers = [bucket for kind, _, bucket, _ in control if kind == Kind.ALL_GATHER]
        # Start-up checks, both steps' exchanges (with the order fingerprint
        # and, at stages 2-3, the late grads: no agreement of their own) and
        # the ranks' meetings on their micro-batch counts (Training._meet).
        assert set(gathers) == {Purpose.NORMS, Purpose.AGREEMENT, Purpose.MICRO_BATCHES}
        assert gathers.count(Purpose.NORMS) == 2
        assert [kind for kind, _, _, _ in control if kind != Kind.ALL_GATHER] == []
        # The data group: data collectives and the model's broadcasts only;
        # stages 2-3's reductions on a group of their own, reduce-scatters only.
        for kind, group, bucket, _ in by_group["data"]:
            assert group >= 0 or (kind, bucket) == (Kind.BROADCAST, Purpose.BROADCASTS), (kind, bucket)
        reductions = by_group["reductions"]
        assert (stage >= 2) == bool(reductions)
        assert all(kind == Kind.REDUCE_SCATTER and group >= 0 for kind, group, _, _ in reductions), reductions
        if stage == 3:
            rounds = by_group["rounds"]
            assert rounds and all((group, bucket) == (zcomm._CONTROL, Purpose.ROUND) for _, group, bucket, _ in rounds)


def _transport_completion(rank, world):
    transport = ProcessGroupTransport(dist.group.WORLD)
    out = {"gloo": transport.all_reduce((2, 0, 0, 4), torch.full((4,), float(rank + 1)))}
    # The other backends' path (NCCL's: tensor collectives that complete
    # through the completion the call returns), run over gloo.
    transport.gloo = False
    t = torch.arange(4.0) + 10 * rank
    shard = torch.empty(2)
    completion = transport.reduce_scatter((1, 0, 1, 4), t, shard)
    assert callable(completion)
    completion()
    out["reduced"] = shard.tolist()
    return out


def test_torch_transport_completes_through_its_works():
    for rank, out in enumerate(run_ranks(_transport_completion, 2, timeout=60)):
        assert out["gloo"] is None  # gloo: completed in the call, on the queue's issuing thread
        assert out["reduced"] == [[10.0, 12.0], [14.0, 16.0]][rank]


def _gloo_tensor_reduce_scatter(rank, world):
    """gloo's reduce-scatter of a tensor it cannot ring (CUDA's, where gloo
    has no send or recv: several ranks on one GPU), run on host tensors by
    saying they cannot ring: the group's tensor collective, completed in the
    call as gloo's are. Returns (whether host and other tensors would ring,
    the call's return, this rank's block)."""
    transport = ProcessGroupTransport(dist.group.WORLD)
    rings = (transport._rings(torch.empty(4)), transport._rings(torch.empty(4, device="meta")))
    transport._rings = lambda input: False
    gen = torch.Generator().manual_seed(rank)
    t = torch.randn(world * 3, generator=gen)
    shard = torch.empty(3)
    returned = transport.reduce_scatter((1, 0, 1, world * 3), t, shard)
    return rings, returned, shard


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_reduce_scatters_a_tensor_it_cannot_ring_with_its_tensor_collective(world):
    inputs = [torch.randn(world * 3, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    total = torch.stack(inputs).double().sum(0).view(world, 3)
    for rank, (rings, returned, shard) in enumerate(run_ranks(_gloo_tensor_reduce_scatter, world, timeout=60)):
        assert rings == (True, False) and returned is None
        torch.testing.assert_close(shard.double(), total[rank], rtol=1e-6, atol=1e-6)


class _CompletesOnRelease:
    """A Python transport whose all-reduce (doubling) moves its data in its
    completion, once released; its second collective fails there."""

    rank, world_size = 0, 1

    def __init__(self):
        self.issued, self.release = threading.Event(), threading.Event()

    def all_reduce(self, key, tensor):
        t = torch.from_dlpack(tensor)
        self.issued.set()

        def complete():
            self.release.wait()
            if key[2] == 1:
                raise ValueError("the peer went away")
            t.mul_(2)
        return complete


def _event_is_the_completion():
    transport = _CompletesOnRelease()
    q = _native.CommQueue(transport, _native.process_backend())
    t = torch.ones(4)
    event = q.all_reduce((2, 0, 0, 4), t)
    failing = q.all_reduce((2, 0, 1, 4), torch.ones(4))
    assert transport.issued.wait(30)
    assert not event.ready() and t.tolist() == [1.0] * 4  # the call returned; the data has not moved
    transport.release.set()
    event.wait()
    assert t.tolist() == [2.0] * 4
    with pytest.raises(RuntimeError, match=r"all_reduce of group 0, bucket 1 .*ValueError: the peer went away"):
        failing.wait()
    q.close()


def test_an_event_is_set_by_the_completion_not_by_the_call_returning():
    run_ranks(lambda rank, world: _event_is_the_completion(), 1, timeout=30)
