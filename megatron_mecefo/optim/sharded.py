"""The distributed optimizer: fp32 master weights and AdamW moments sharded over logical replicas.

Why not megatron's `DistributedOptimizer`: it binds its DP group and cuts its buffers by that
group's size at construction, and under failover megatron sees one replica (the membership owns
cross-replica traffic). Here the flat parameter space is cut into one shard per *logical* replica
(`layout.FlatLayout`), so a shard keeps its identity when membership changes, and which live
replicas hold it is a pure function of the members (`placement`). Gradients arrive all-reduced
(`mcore.stack.PlanGradReducer`); each holder updates its shards with the same arithmetic as
torch's AdamW, and the shards' primaries all-gather the new parameters. With one copy per shard
(the static job) a replica stores 12/n bytes of optimizer state per parameter instead of 12.

State of a held shard: fp32 `master`, `exp_avg`, `exp_avg_sq`. The step count is shared.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from megatron_mecefo.optim import placement as place
from megatron_mecefo.optim.adamw import adamw_
from megatron_mecefo.optim.layout import FlatLayout

KIND = "mecefo-sharded-adamw"
GATHER_WINDOW = 1 << 26
"""Elements per member in one all-gather call (bounds the scratch buffer)."""


@dataclasses.dataclass
class ShardState:
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def digest(self) -> str:
        h = hashlib.sha256()
        for t in (self.master, self.exp_avg, self.exp_avg_sq):
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class AdamHyper:
    betas: tuple[float, float]
    eps: float
    clip_grad: float


class ShardedOptimizer:
    """AdamW over shards of the flat parameter space (see the module docstring).

    Args:
        groups: megatron's parameter groups (`stack.optimizer_param_groups`).
        names: parameter -> name.
        membership: the DP membership (`members`, `replica`, `all_gather`).
        copies: replicas that hold each shard (1: plain ZeRO-1; failover: 2, a live copy
            survives any single death).
        replicas_per_node: copies go to different nodes first.
        placed: hold this replica's shards from the start (static jobs). Failover passes False:
            the first regroup places them (`failover/trainer/shards.py`), so a trainer never
            holds more than its share.
    """

    def __init__(
        self,
        groups: list[dict[str, Any]],
        names: dict[torch.Tensor, str],
        membership,
        hyper: AdamHyper,
        *,
        lr: float,
        weight_decay: float,
        copies: int = 1,
        replicas_per_node: int = 1,
        placed: bool = True,
    ):
        from megatron_mecefo.mcore import stack

        self.layout = FlatLayout([g["params"] for g in groups], names, membership.num_replicas)
        self.param_groups = [
            {
                "params": g["params"],
                "wd_mult": g["wd_mult"],
                "lr_mult": g["lr_mult"],
                "lr": lr * g["lr_mult"],
                "weight_decay": weight_decay * g["wd_mult"],
            }
            for g in groups
        ]
        self.membership = membership
        self.hyper = hyper
        self.copies = max(1, min(copies, membership.num_replicas))
        self.replicas_per_node = max(1, replicas_per_node)
        self.step_count = 0
        self.stale = False
        """A parameter all-gather failed: this rank's parameters are not all current. Cleared by
        the next complete gather (the regroup's)."""
        self.held: dict[int, ShardState] = {}
        self._norm_params = [p for p in self.layout.params if stack.counts_in_grad_norm(p)]
        self._grad_norm = stack.grad_norm
        self.disk: tuple[str, int, int, int] | None = None
        """(checkpoint folder, step count, stage, TP rank) whose shard files a placement not yet
        made will read (failover resumes place shards only at the first regroup)."""
        self.where: tuple[tuple[int, ...], ...] | None = None
        if placed:
            self.where = self.placement(membership.members)
            for s in place.held_by(membership.replica, self.where):
                self.held[s] = self.fresh_shard(s)

    # ------------------------------------------------------------------ placement
    def placement(self, members: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        """Which members hold each shard when `members` are alive."""
        return place.placement(
            members,
            num_replicas=self.layout.num_shards,
            copies=self.copies,
            replicas_per_node=self.replicas_per_node,
        )

    def fresh_shard(self, shard: int) -> ShardState:
        """A shard's state at step 0: master = the current parameters, zero moments."""
        n = self.layout.shard_len(shard)
        master = torch.empty(n, dtype=torch.float32, device=self.device)
        self.layout.gather_from_params(shard, master)
        return ShardState(master, torch.zeros_like(master), torch.zeros_like(master))

    @property
    def device(self) -> torch.device:
        return self.layout.params[0].device if self.layout.params else torch.device("cpu")

    # ------------------------------------------------------------------ step
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: gradients live in DDP's buffers (`zero_grad_buffer`)."""

    @torch.no_grad()
    def step(self) -> tuple[bool, float, None]:
        """Clip by the global norm, update the held shards, all-gather the parameters.

        Returns (updated, grad norm, None) like megatron's optimizers.
        """
        norm = self._grad_norm([p.main_grad for p in self._norm_params])
        clip = self.hyper.clip_grad
        coeff = clip / (norm + 1.0e-6) if clip > 0 else 1.0
        self.step_count += 1
        lrs = [g["lr"] for g in self.param_groups]
        wds = [g["weight_decay"] for g in self.param_groups]
        grad = torch.empty(self.layout.shard_numel, dtype=torch.float32, device=self.device)
        for s, st in sorted(self.held.items()):
            g = grad[: st.master.numel()]
            self.layout.gather_from_params(s, g, source="main_grad")
            if coeff < 1.0:
                g.mul_(coeff)
            adamw_(
                st.master,
                st.exp_avg,
                st.exp_avg_sq,
                g,
                step=self.step_count,
                lr=lrs,
                weight_decay=wds,
                runs=self.layout.runs(s),
                beta1=self.hyper.betas[0],
                beta2=self.hyper.betas[1],
                eps=self.hyper.eps,
            )
        self.gather_params()
        return True, norm, None

    def state_views(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Views of the held shards' master and moments over `params` (`stack.hold_params`)."""
        wanted = {id(p) for p in params}
        out = []
        for s, st in sorted(self.held.items()):
            for piece in self.layout.pieces(s):
                if id(self.layout.params[piece.param]) in wanted:
                    lo = piece.shard_lo
                    hi = lo + piece.param_hi - piece.param_lo
                    out += [t[lo:hi] for t in (st.master, st.exp_avg, st.exp_avg_sq)]
        return out

    @torch.no_grad()
    def gather_params(self) -> bool:
        """Every shard's primary sends its master (in the parameters' dtype); every member writes
        all shards into its parameters. Collective over the members. False (and `stale`) if a
        call failed; the rounds are still all issued so members stay aligned."""
        m = self.membership
        members = tuple(m.members)
        if self.where is None:
            raise RuntimeError("the optimizer's shards are not placed yet")
        served = [place.served_by(r, self.where) for r in members]
        missing = [s for s, hs in enumerate(self.where) if not hs]
        if missing:
            raise RuntimeError(f"shards {missing} have no live holder; cannot gather parameters")
        mine = served[members.index(m.replica)]
        dtype = self.layout.params[0].dtype
        size, width = len(members), min(self.layout.shard_numel, GATHER_WINDOW)
        ok = True
        for k in range(max(len(x) for x in served)):
            for lo in range(0, self.layout.shard_numel, width):
                w = min(width, self.layout.shard_numel - lo)
                send = torch.zeros(w, dtype=dtype, device=self.device)
                if k < len(mine):
                    src = self.held[mine[k]].master[lo : lo + w]
                    send[: src.numel()].copy_(src)
                out = torch.empty(size * w, dtype=dtype, device=self.device)
                if not m.all_gather(out, send):
                    ok = False
                    continue
                for j in range(size):
                    if k < len(served[j]):
                        self.layout.scatter_to_params(served[j][k], out[j * w : (j + 1) * w], lo)
        self.stale = not ok
        return ok

    # ------------------------------------------------------------------ holdings
    def set_holdings(self, where: tuple[tuple[int, ...], ...]) -> None:
        """Adopt placement `where` (the regroup moved the shards already); drop shards this
        replica no longer holds."""
        self.where = where
        for s in [s for s in self.held if self.membership.replica not in where[s]]:
            del self.held[s]

    def digests(self) -> dict[int, str]:
        """Held shard -> SHA-256 prefix of its master and moments."""
        return {s: st.digest() for s, st in sorted(self.held.items())}

    def nbytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        return sum(
            t.numel() * t.element_size() for st in self.held.values() for t in st.tensors().values()
        )

    # ------------------------------------------------------------------ checkpoints
    def write_served(self, folder: str, pp: int, tp: int) -> list[int]:
        """Write the shards this replica serves into `folder` (every member calls this: each
        shard is written once, by its primary)."""
        from megatron_mecefo.optim import shard_files

        mine = place.served_by(self.membership.replica, self.where or ())
        for s in mine:
            shard_files.write(
                folder, self.layout, pp, tp, s, self.step_count, self.held[s].tensors()
            )
        return list(mine)

    def load_checkpoint(self, folder: str, pp: int, tp: int) -> None:
        """Take the step count and (once placed) the held shards from `folder`'s shard files."""
        from megatron_mecefo.optim import shard_files

        mine = [] if self.where is None else place.held_by(self.membership.replica, self.where)
        # every file is read (and checked) once; unplaced, shard 0 stands in for the step count
        self.step_count, got = shard_files.read_shards(
            folder, self.layout, pp, tp, list(mine) or [0]
        )
        if self.where is None:
            self.disk = (str(folder), self.step_count, pp, tp)
            return
        for s in mine:
            self.held[s] = self._on_device(got[s])

    def read_disk(self, shard: int) -> ShardState:
        """Shard `shard` from the checkpoint `load_checkpoint` recorded."""
        from megatron_mecefo.optim import shard_files

        folder, _, pp, tp = self.disk
        return self._on_device(shard_files.read(folder, self.layout, pp, tp, shard)[1])

    def _on_device(self, tensors: dict[str, torch.Tensor]) -> ShardState:
        return ShardState(**{k: v.to(self.device) for k, v in tensors.items()})

    # ------------------------------------------------------------------ state
    def meta(self) -> dict[str, Any]:
        return {"kind": KIND, "step": self.step_count, "layout": self.layout.describe()}

    def state_dict(self, shards: bool = True) -> dict[str, Any]:
        """The step count, the layout and the held shards (references, not copies); without
        `shards`, what a rejoining replica needs before it receives its shards."""
        if not shards:
            return self.meta()
        return {
            **self.meta(),
            "shards": {s: st.tensors() for s, st in sorted(self.held.items())},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the step count and the shards of `state` (it must be of this layout). Shards it
        lacks that this replica should hold are not invented: a load that leaves one missing
        raises."""
        self.check_meta(state)
        self.step_count = int(state["step"])
        self.disk = None
        shards = state.get("shards")
        if shards is None:  # a rejoiner: its shards come from their holders
            self.held = {}
            return
        self.held = {
            int(s): ShardState(**{k: v.to(self.device, copy=True) for k, v in t.items()})
            for s, t in shards.items()
        }
        if self.where is None:  # failover: the next regroup places them
            return
        want = place.held_by(self.membership.replica, self.where)
        missing = [s for s in want if s not in self.held]
        if missing:
            raise RuntimeError(f"optimizer state lacks shards {missing} this replica holds")

    def check_meta(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("kind") != KIND:
            raise RuntimeError(
                "optimizer state is not a sharded one (training.use_distributed_optimizer "
                "differs from the run that wrote it)"
            )
        theirs = state["layout"]["signature"]
        if (
            theirs != self.layout.signature()
            or state["layout"]["numel"] != self.layout.numel
            or state["layout"]["num_shards"] != self.layout.num_shards
        ):
            raise RuntimeError(
                f"optimizer state of another parameter layout ({theirs}, "
                f"this run {self.layout.signature()})"
            )
