"""RemoteAgents in process, with a fake NIXL agent and a fake clock."""

from __future__ import annotations

from typing import Any

from kvcr_node.agents import DEPARTED_AGENTS, FORGOTTEN_NAMES, IDLE_PROGRESS_S, AgentUse, RemoteAgents


class FakeAgent:
    """Records what a RemoteAgents asks of NIXL; metadata is the agent's name as bytes."""

    def __init__(self) -> None:
        self.removed: list[str] = []
        self.progressed = 0

    def add_remote(self, metadata: bytes) -> str:
        return metadata.decode()

    def remove_remote(self, name: str) -> None:
        self.removed.append(name)

    def progress(self) -> None:
        self.progressed += 1


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(uses: dict[str, AgentUse]) -> tuple[RemoteAgents, FakeAgent, Clock]:
    agent, clock = FakeAgent(), Clock()
    agents = RemoteAgents(agent, uses.get, clock)  # type: ignore[arg-type]
    return agents, agent, clock


def test_held_agents_stay_running_ones_wait_and_departed_ones_are_removed_oldest_first() -> None:
    uses: dict[str, AgentUse] = {"held": AgentUse.HELD, "busy": AgentUse.RUNNING}
    agents, nixl, _ = make(uses)
    for name in ("held", "busy"):
        agents.add(name.encode())
    agents.release("held")
    agents.release("busy")
    assert agents.sizes() == {"remote_agents": 2, "remote_agents_departed": 0, "remote_agents_pending": 1, "remote_agents_gone": 0}
    del uses["busy"]  # its operation finished
    agents.release_pending()
    assert agents.sizes() == {"remote_agents": 2, "remote_agents_departed": 1, "remote_agents_pending": 0, "remote_agents_gone": 0}
    names = [f"c{i}" for i in range(DEPARTED_AGENTS + 3)]
    for name in names:
        agents.add(name.encode())
        agents.release(name)
    # "busy" departed first, then c0, c1, ...: the oldest beyond the bound are removed from NIXL.
    assert nixl.removed == ["busy", "c0", "c1", "c2"]
    assert agents.sizes()["remote_agents_departed"] == DEPARTED_AGENTS
    assert "held" in agents.loaded and "held" not in agents.departed


def test_a_departed_agent_that_comes_back_is_reused_not_removed() -> None:
    agents, nixl, _ = make({})
    agents.add(b"client")
    agents.release("client")
    assert "client" in agents.departed
    agents.add(b"client")  # the same client opens a new session
    assert "client" not in agents.departed and "client" in agents.loaded
    agents.release("unknown")  # never loaded: nothing to do
    assert nixl.removed == []


def test_idle_progress_is_paced_by_the_clock() -> None:
    agents, nixl, clock = make({})
    agents.progress_idle()
    agents.progress_idle()
    assert nixl.progressed == 1
    clock.now += IDLE_PROGRESS_S
    agents.progress_idle()
    assert nixl.progressed == 2


def test_a_failing_removal_is_logged_not_raised(caplog: Any) -> None:
    agents, nixl, _ = make({})

    def refuse(name: str) -> None:
        raise RuntimeError("NIXL refused")

    nixl.remove_remote = refuse  # type: ignore[method-assign]
    for i in range(DEPARTED_AGENTS + 1):
        agents.add(f"a{i}".encode())
        agents.release(f"a{i}")
    assert "a0" not in agents.loaded


def test_a_forgotten_agent_is_removed_once_nothing_holds_or_runs_on_it() -> None:
    """A target said the client left (spec section 5.3): its agent is removed, not kept
    departed; while a write still runs on it, it waits; another holder keeps it."""
    uses: dict[str, AgentUse] = {}
    agents, nixl, _ = make(uses)
    for name in ("idle", "busy", "shared"):
        agents.add(name.encode())
    agents.forget("idle")
    assert nixl.removed == ["idle"] and "idle" not in agents.loaded and "idle" not in agents.departed
    uses["busy"] = AgentUse.RUNNING
    agents.forget("busy")
    assert nixl.removed == ["idle"] and agents.sizes()["remote_agents_pending"] == 1
    assert agents.sizes()["remote_agents_gone"] == 1
    del uses["busy"]  # its write ended
    agents.release_pending()
    assert nixl.removed == ["idle", "busy"]
    uses["shared"] = AgentUse.HELD  # another session (or another target's announcement) names it
    agents.forget("shared")
    assert nixl.removed == ["idle", "busy"] and "shared" in agents.loaded
    del uses["shared"]
    agents.release("shared")  # its own holder let go: an ordinary departure, kept for reuse
    assert "shared" in agents.departed and nixl.removed == ["idle", "busy"]
    agents.forget("shared")  # departed already, now known gone: removed
    agents.forget("never-loaded")
    agents.forget("idle")  # twice: nothing more
    assert nixl.removed == ["idle", "busy", "shared"]
    assert agents.sizes() == {"remote_agents": 0, "remote_agents_departed": 0, "remote_agents_pending": 0, "remote_agents_gone": 0}


def test_a_forgotten_agent_announced_again_is_kept() -> None:
    uses: dict[str, AgentUse] = {"c": AgentUse.RUNNING}
    agents, nixl, _ = make(uses)
    agents.add(b"c")
    agents.forget("c")
    agents.add(b"c")  # the client came back before its old write ended
    uses["c"] = AgentUse.HELD
    agents.release_pending()
    del uses["c"]
    agents.release("c")
    assert nixl.removed == [] and "c" in agents.departed


def test_an_agent_forgotten_again_after_its_removal_departs() -> None:
    """A live process that cycles its sessions (announced, forgotten, announced again): the
    first forget removes its agent, later ones keep it departed and reuse it, since every
    removal of a live agent costs a connection until that process leaves (architecture §6)."""
    agents, nixl, _ = make({})
    agents.add(b"cycling")
    agents.forget("cycling")
    assert nixl.removed == ["cycling"]
    for _ in range(10):
        agents.add(b"cycling")
        agents.forget("cycling")
        assert "cycling" in agents.departed
    assert nixl.removed == ["cycling"]
    # The names remembered stay bounded.
    for i in range(FORGOTTEN_NAMES + 5):
        agents.add(f"n{i}".encode())
        agents.forget(f"n{i}")
    assert len(agents.forgotten) == FORGOTTEN_NAMES and "n0" not in agents.forgotten
    assert agents.sizes()["remote_agents"] == 1  # only "cycling", departed
