"""torch.distributed's point-to-point calls with NCCL's contract, for ranks run as threads.

No GPU is lent to the tests, so what differs on NCCL is modelled here and the building blocks are
run under it (tests/test_nccl_contract.py):

- `batch_isend_irecv` returns ONE Work for the whole batch (torch coalesces a batch of CUDA
  ops), and a receive's buffer holds its data only once that Work has been waited for (here it
  holds NaN until then, so a read before the wait shows in the results);
- a rank's batches run one after another, in posting order, on one stream; the ops of one batch
  run together;
- between two ranks the k-th send posted is matched with the k-th receive posted: tags are ignored;
- a send completes only when its matching receive runs (no buffering), so two ranks whose streams
  each start with a send to the other wait for ever: `wait` raises TimeoutError instead.

`simulate.p2p_deadlock` is the same rules without threads or tensors.
"""
import collections
import threading
import types


class Work:
    def __init__(self, p2p, batch):
        self.p2p, self.batch = p2p, batch

    def wait(self):
        p2p = self.p2p
        with p2p.cond:
            if not p2p.cond.wait_for(lambda: self.batch.done, timeout=p2p.timeout):
                raise TimeoutError(f"rank {self.batch.rank}: a batch_isend_irecv never completed under NCCL's "
                                   f"rules (a cycle of waits): {p2p.describe()}")
            for op in self.batch.ops:
                if op.op == NcclLikeP2P.irecv and not op.delivered:
                    op.tensor.copy_(op.data)
                    op.delivered = True
        return True

    def is_completed(self):
        return self.batch.done


class ThreadGather:
    """`all_gather` for ranks run as threads: every rank of the group (len(tensor_list) of them,
    or `group.ranks`) deposits its tensor, and each gets all of them in rank order."""

    def all_gather(self, tensor_list, tensor, group=None):
        if not hasattr(self, "gathered"):
            self.gathered, self.gathers = collections.defaultdict(dict), collections.Counter()
        me = self.local.rank
        ranks = tuple(group.ranks) if group is not None else tuple(range(len(tensor_list)))
        with self.cond:
            key = (ranks, self.gathers[me])
            self.gathers[me] += 1
            self.gathered[key][me] = tensor.detach().clone()
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: len(self.gathered[key]) == len(ranks), timeout=getattr(self, "timeout", 20)):
                raise TimeoutError(f"rank {me}: all_gather {key[1]} never completed")
        for out, r in zip(tensor_list, ranks):
            out.copy_(self.gathered[key][r])


class NcclLikeP2P(ThreadGather):
    """Patch a module's `dist` with an instance: `monkeypatch.setattr(module, "dist", NcclLikeP2P())`.
    Each thread sets `p2p.local.rank` to its global rank before its first call."""
    isend, irecv = "isend", "irecv"

    def __init__(self, timeout=20.0):
        self.cond, self.local, self.timeout = threading.Condition(), threading.local(), timeout
        self.streams = collections.defaultdict(collections.deque)
        self.sent, self.received = collections.Counter(), collections.Counter()
        self.batches = 0         # batches posted, all ranks
        self.works_returned = 0

    def P2POp(self, op, tensor, peer, group=None, tag=0):
        return types.SimpleNamespace(op=op, tensor=tensor, peer=peer, group=group, tag=tag)

    def get_global_rank(self, group, r):
        return group.ranks[r] if group is not None else r

    def get_rank(self, group=None):
        return self.local.rank if group is None else group.ranks.index(self.local.rank)

    def batch_isend_irecv(self, ops):
        me = self.local.rank
        with self.cond:
            batch = types.SimpleNamespace(rank=me, ops=[], done=False)
            for op in ops:
                pair = (me, op.peer) if op.op == self.isend else (op.peer, me)
                count = self.sent if op.op == self.isend else self.received
                if op.op == self.irecv and op.tensor.is_floating_point():
                    op.tensor.fill_(float("nan"))        # nothing has arrived yet
                batch.ops.append(types.SimpleNamespace(op=op.op, tensor=op.tensor, pair=pair, k=count[pair],
                                                       done=False, data=None, delivered=False))
                count[pair] += 1
            self.streams[me].append(batch)
            self.batches += 1
            self._progress()
            self.cond.notify_all()
        self.works_returned += 1
        return [Work(self, batch)]

    def _progress(self):
        """Match the ops of the batches at the heads of the streams; retire the finished ones."""
        moved = True
        while moved:
            moved = False
            for rank, stream in list(self.streams.items()):
                if not stream:
                    continue
                for op in stream[0].ops:
                    if op.done or op.op != self.isend:
                        continue
                    peer = self.streams.get(op.pair[1])
                    if not peer:
                        continue
                    for other in peer[0].ops:
                        if other.op == self.irecv and not other.done and other.pair == op.pair and other.k == op.k:
                            if other.tensor.shape != op.tensor.shape or other.tensor.dtype != op.tensor.dtype:
                                raise RuntimeError(f"NCCL would copy a {tuple(op.tensor.shape)} {op.tensor.dtype} "
                                                   f"send into a {tuple(other.tensor.shape)} {other.tensor.dtype} "
                                                   f"receive (pair {op.pair}, message {op.k})")
                            other.data = op.tensor.detach().clone()
                            op.done = other.done = moved = True
            for stream in self.streams.values():
                while stream and all(op.done for op in stream[0].ops):
                    stream.popleft().done = True
                    moved = True

    def describe(self):
        return "; ".join(f"rank {r} waits on {[(o.op, o.pair, o.k) for o in s[0].ops if not o.done]}"
                         for r, s in sorted(self.streams.items()) if s)


def run_ranks(fn, ranks, timeout=60.0):
    """Run fn(rank) on one thread per (global) rank; returns {rank: result}; re-raises the first
    rank's exception."""
    results, errors = {}, []

    def main(r):
        try:
            results[r] = fn(r)
        except BaseException as e:   # noqa: BLE001  (reported below)
            errors.append((r, e))
    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"ranks still running after {timeout} s")
    if errors:
        r, e = errors[0]
        raise AssertionError(f"rank {r} raised {type(e).__name__}: {e}") from e
    return results
