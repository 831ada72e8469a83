"""What the scheduler's tests share: a scheduler built small, requests of a given prompt length, a fake runner
that steps it on the CPU, and the checks every step and every test ends with.

The fake runner keeps a 'KV cache' whose slots hold the token prefix they were computed from. Before
each step it checks that every already-computed position reads back the right prefix through the
request's block table, so a wrong prefix hit, a bad swap pair or a reused live block fails the test.
"""

from kvrelay.shared.config.engine import SchedulerConfig
from kvrelay.shared.engine.block_manager import BlockManager, cdiv
from kvrelay.shared.engine.request import Request, RequestStatus
from kvrelay.shared.engine.scheduler import Scheduler, SchedulerOutput
from kvrelay.shared.wire.sampling_params import SamplingParams

BS = 4
EOS = 2


class FakeRunner:
    def __init__(self, sched: Scheduler, token=lambda req: 7):
        bm = sched.block_manager
        self.sched, self.bm, self.token = sched, bm, token
        self.dev: list[list] = [[None] * BS for _ in range(bm.num_blocks)]
        self.host: list[list] = [[None] * BS for _ in range(sched.host_pool.num_blocks)]

    def step(self) -> tuple[SchedulerOutput, list[Request]]:
        out = self.sched.schedule()
        check_invariants(self.sched, out)
        for d, h in out.swap_out:  # the order the real runner uses: swap-outs, swap-ins, compute
            self.host[h] = list(self.dev[d])
        for h, d in out.swap_in:
            self.dev[d] = list(self.host[h])
        sampled = {}
        for s in out.scheduled:
            r, c = s.request, s.request.num_computed_tokens
            toks = r.all_token_ids
            for p in range(c):
                assert self.dev[s.block_ids[p // BS]][p % BS] == (r.cache_salt, tuple(toks[: p + 1])), (r.request_id, p)
            for p in range(c, c + s.num_new_tokens):
                block = s.block_ids[p // BS]
                assert self.bm.ref_cnt[block] == 1, "writing into a shared block"
                self.dev[block][p % BS] = (r.cache_salt, tuple(toks[: p + 1]))
            if s.sample:
                sampled[r.request_id] = [self.token(r)]
        return out, self.sched.update_from_output(out, sampled)

    def run(self, max_steps: int = 500) -> list[Request]:
        done = []
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return done
            done += self.step()[1]
        raise AssertionError("scheduler did not drain")


def check_invariants(sched: Scheduler, out: SchedulerOutput) -> None:
    assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    assert len(out.scheduled) <= sched.config.max_num_seqs
    assert len({s.request.request_id for s in out.scheduled}) == len(out.scheduled)
    for s in out.scheduled:
        r = s.request
        assert s.num_new_tokens > 0 and r.num_computed_tokens + s.num_new_tokens <= r.num_tokens
        assert len(s.block_ids) >= cdiv(r.num_computed_tokens + s.num_new_tokens, BS)
        assert r.status is RequestStatus.RUNNING
    bm = sched.block_manager
    owned = sum(len(v) for v in bm.req_blocks.values())
    assert owned == sum(bm.ref_cnt)  # every reference belongs to exactly one table entry
    assert not set(bm.free_queue) & {b for b, n in enumerate(bm.ref_cnt) if n}
    assert len({h for _, h in out.swap_out}) == len(out.swap_out)
    # A request preempted this step is neither scheduled nor re-admitted in it.
    assert not set(out.preempted) & {x.request.request_id for x in out.scheduled}


def make(
    num_blocks=64,
    max_model_len=64,
    budget=None,
    chunked=True,
    max_seqs=256,
    policy="fcfs",
    host=0,
    prefix=True,
    hold=False,
    quota=None,
) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked, policy=policy,
        tenant_kv_quota=quota,
    )
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=prefix)
    return Scheduler(cfg, bm, max_model_len, num_host_blocks=host, enable_prefix_caching=prefix, hold_finished_kv=hold)


def rq(rid: str, n_prompt: int, max_tokens: int = 4, base: int = 10, priority: int = 0, **sp) -> Request:
    prompt = [base + (i % 50) for i in range(n_prompt)]
    return Request(rid, prompt, SamplingParams(**sp), eos_token_id=EOS, max_tokens=max_tokens, priority=priority)


def assert_clean(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert not sched.has_unfinished() and bm.num_free_blocks == bm.num_blocks and bm.usage == 0
    assert sched.host_pool.num_free_blocks == sched.host_pool.num_blocks
    assert bm.req_blocks == {} and sched.num_held == 0



def batch(out: SchedulerOutput) -> list[tuple[str, int]]:
    """A step's batch: each scheduled request's id and how many tokens it computes."""
    return [(x.request.request_id, x.num_new_tokens) for x in out.scheduled]


def two_growing(s: Scheduler) -> FakeRunner:
    """a and b fill the 4-block pool; at the third step a needs a new block."""
    s.add_request(rq("a", 7, max_tokens=4, base=10))
    s.add_request(rq("b", 7, max_tokens=4, base=30))
    runner = FakeRunner(s)
    out, _ = runner.step()
    assert len(out.scheduled) == 2 and s.block_manager.num_free_blocks == 0
    out, _ = runner.step()
    assert not out.preempted
    return runner
