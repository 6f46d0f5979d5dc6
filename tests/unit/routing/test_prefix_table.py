"""The prefix-affinity rule: matching, load first, replicas leaving, bounded memory."""

from __future__ import annotations

import pytest

from serve_app.routing.prefix_table import (
    Choice,
    Decision,
    PrefixTable,
    RoutingKey,
    RunningPrompts,
    choose,
    home_replica,
    opening_digest,
    prefix_blocks,
)

BLOCK = 8


def key(text: str, opening: str = "") -> RoutingKey:
    return RoutingKey(prefix_blocks(text, BLOCK), opening_digest(opening), len(opening) // BLOCK, opening_digest(text))


def test_a_block_names_its_whole_prefix_and_only_full_blocks_count():
    blocks = prefix_blocks("a" * 8 + "b" * 8 + "c" * 3, BLOCK)
    assert len(blocks) == 2
    assert prefix_blocks("a" * 8 + "b" * 8 + "x" * 9, BLOCK)[:2] == blocks  # same start, same names
    assert prefix_blocks("z" * 8 + "b" * 8, BLOCK)[1] != blocks[1]  # same block after another start
    assert prefix_blocks("short", BLOCK) == ()


def test_a_prompt_under_another_cache_salt_matches_nothing_and_has_its_own_home():
    """Keyed as the engine's cache is: another API key's identical prompt finds no holder of it."""
    table = PrefixTable(max_blocks=100)
    text = "a" * 8 + "b" * 8
    table.record(prefix_blocks(text, BLOCK, "salt-a"), "r1")
    assert table.longest_match(prefix_blocks(text, BLOCK, "salt-a"), {"r1", "r2"}) == (2, ("r1",))
    assert table.longest_match(prefix_blocks(text, BLOCK, "salt-b"), {"r1", "r2"}) == (0, ())
    assert table.longest_match(prefix_blocks(text, BLOCK), {"r1", "r2"}) == (0, ())
    assert opening_digest(text, "salt-a") != opening_digest(text, "salt-b") != opening_digest(text)


def test_the_longest_known_prefix_wins_and_only_among_live_candidates():
    table = PrefixTable(max_blocks=100)
    system = "S" * 32
    table.record(prefix_blocks(system + "conversation one, turn one", BLOCK), "r1")
    table.record(prefix_blocks(system + "conversation two, turn one", BLOCK), "r2")
    turn_two = prefix_blocks(system + "conversation one, turn one" + " answer; turn two", BLOCK)
    depth, holders = table.longest_match(turn_two, {"r1", "r2"})
    assert holders == ("r1",) and depth == len(prefix_blocks(system + "conversation one, turn one", BLOCK))
    shared = len(prefix_blocks(system + "conversation ", BLOCK))  # the system prompt and "conversa"
    assert table.longest_match(turn_two, {"r2"}) == (shared, ("r2",))  # r1 not a candidate
    assert table.longest_match(prefix_blocks("unrelated " * 4, BLOCK), {"r1", "r2"}) == (0, ())


def test_a_later_turn_goes_where_its_conversation_went_even_away_from_its_home():
    table = PrefixTable(max_blocks=100)
    opening = "system prompt. first question?"
    turn_one = opening + " <assistant>"
    replicas = {"r1": 0, "r2": 0, "r3": 0}
    home = home_replica(opening_digest(opening), replicas)
    elsewhere = next(r for r in replicas if r != home)
    table.record(prefix_blocks(turn_one, BLOCK), elsewhere)  # (a fallback once sent it there)
    choice = choose(key(turn_one + " answer. second question?", opening), table, replicas, max_load_gap=4)
    assert choice == Choice(elsewhere, Decision.AFFINITY, len(turn_one) // BLOCK)


def test_a_first_turn_goes_home_whatever_shared_prefix_another_replica_holds():
    """Every ingress replica (each with its own table) sends a conversation's first turn to the
    same replica: one picked from its opening alone."""
    system = "a long shared system prompt " * 4
    table = PrefixTable(max_blocks=100)
    replicas = {"r1": 0, "r2": 0, "r3": 0, "r4": 0}
    for n, replica in enumerate(replicas):
        table.record(prefix_blocks(system + f"user {n}", BLOCK), replica)
    homes = set()
    for n in range(20):
        opening = system + f"a new user's question {n}"
        choice = choose(key(opening + "<assistant>", opening), table, replicas, max_load_gap=4)
        assert choice.decision is Decision.HOME
        assert choice.replica == home_replica(opening_digest(opening), replicas)
        assert choose(key(opening + "<assistant>", opening), PrefixTable(10), replicas, 4) == Choice(
            choice.replica, Decision.HOME, 0
        )  # another ingress replica, which has seen nothing, agrees
        homes.add(choice.replica)
    assert len(homes) > 1  # openings spread over the replicas


def test_a_busy_holder_loses_the_request_to_load():
    table = PrefixTable(max_blocks=100)
    text = "the same prompt, many times over"
    table.record(prefix_blocks(text, BLOCK), "r1")
    assert choose(key(text), table, {"r1": 20, "r2": 4}, max_load_gap=16).replica == "r1"  # 16 more: still r1
    assert choose(key(text), table, {"r1": 21, "r2": 4}, max_load_gap=16) == Choice(None, Decision.FALLBACK, 4)


def test_one_hot_prefix_spreads_over_every_replica_it_overflows_to():
    """Simulated routing of one prompt sent 400 times with 64 in flight: the first holder fills
    to the gap, the overflow goes by load, and from then on the least busy holder takes it."""
    table = PrefixTable(max_blocks=100)
    replicas = ["r1", "r2", "r3", "r4"]
    loads = dict.fromkeys(replicas, 0)
    counts = dict.fromkeys(replicas, 0)
    hot = key("one hot prompt that everyone sends " * 3, "one hot prompt")
    in_flight: list[str] = []
    for _ in range(400):
        if len(in_flight) == 64:  # the oldest request ends
            loads[in_flight.pop(0)] -= 1
        choice = choose(hot, table, loads, max_load_gap=8)
        replica = choice.replica or min(loads, key=loads.__getitem__)  # (load's choice, simplified)
        table.record(hot.blocks, replica)
        loads[replica] += 1
        counts[replica] += 1
        in_flight.append(replica)
    mean = sum(counts.values()) / len(counts)
    assert max(counts.values()) <= 1.3 * mean, counts


def test_one_hot_opening_is_spread_even_below_the_load_gap():
    """Eight conversations that all start alike, sent at once to two idle replicas: the first
    goes home, each next one to a less busy replica than one already running that opening."""
    table, running = PrefixTable(max_blocks=100), RunningPrompts(max_requests=100)
    loads = {"r1": 0, "r2": 0}
    hot = key("You are a helpful assistant. Question 1?", "You are a helpful assistant. Question 1?")
    decisions = []
    for n in range(8):
        choice = choose(hot, table, loads, max_load_gap=16, running_same_prompt=running.replicas(hot.whole, loads))
        replica = choice.replica or min(loads, key=loads.__getitem__)  # (load's choice, simplified)
        decisions.append(choice.decision)
        table.record(hot.blocks, replica)
        running.started(f"req{n}", replica, hot.whole)
        loads[replica] += 1
    assert loads == {"r1": 4, "r2": 4}, (loads, decisions)
    assert Decision.SPREAD in decisions


def test_a_later_turn_stays_with_its_history_while_other_openings_run_there():
    table, running = PrefixTable(max_blocks=100), RunningPrompts(max_requests=100)
    opening = "System: be brief. User: hello"
    turn_2 = key(opening + " Assistant: hi. User: and then?", opening)
    table.record(prefix_blocks(opening + " Assistant: hi.", BLOCK), "r2")
    other = key("System: another conversation", "System: another conversation")
    running.started("other", "r2", other.whole)
    loads = {"r1": 0, "r2": 5}
    choice = choose(turn_2, table, loads, max_load_gap=16, running_same_prompt=running.replicas(turn_2.whole, loads))
    assert (choice.replica, choice.decision) == ("r2", Decision.AFFINITY)


def test_a_later_turn_stays_with_its_history_while_its_own_opening_runs_there():
    """Its previous turn may not have been reported ended yet when the next one arrives (the
    client has its answer first), or a conversation that started alike runs there: a later turn
    still goes where its history is, not to a less busy replica that holds none of it."""
    table, running = PrefixTable(max_blocks=100), RunningPrompts(max_requests=100)
    opening = "System: be brief. User: hello"
    turn_1 = key(opening, opening)
    table.record(turn_1.blocks, "r2")
    running.started("turn-1, not yet reported ended", "r2", turn_1.whole)
    turn_2 = key(opening + " Assistant: hi. User: and then?", opening)
    table.record(prefix_blocks(opening + " Assistant: hi.", BLOCK), "r2")
    loads = {"r1": 0, "r2": 1}
    choice = choose(turn_2, table, loads, max_load_gap=16, running_same_prompt=running.replicas(turn_2.whole, loads))
    assert (choice.replica, choice.decision) == ("r2", Decision.AFFINITY)
    # A copy of the first turn itself (seen whole) is spread, as one hot prompt is.
    copy = choose(turn_1, table, loads, max_load_gap=16, running_same_prompt=running.replicas(turn_1.whole, loads))
    assert (copy.replica, copy.decision) == (None, Decision.SPREAD)


def test_a_later_turn_that_adds_less_than_a_block_is_no_copy_of_the_turn_before():
    """Its blocks then match the previous turn's whole, which still runs (or, with direct
    streaming, is never reported ended): it stays with its history all the same."""
    table, running = PrefixTable(max_blocks=100), RunningPrompts(max_requests=100)
    opening = "System: be brief. User: hello"
    turn_1 = key(opening, opening)
    turn_2 = key(opening + "!?", opening)  # less than a block more (29 + 2 characters: 3 blocks of 8)
    assert turn_2.blocks == turn_1.blocks and turn_2.whole != turn_1.whole
    table.record(turn_1.blocks, "r2")
    running.started("turn-1", "r2", turn_1.whole)
    loads = {"r1": 0, "r2": 1}
    choice = choose(turn_2, table, loads, max_load_gap=16, running_same_prompt=running.replicas(turn_2.whole, loads))
    assert (choice.replica, choice.decision) == ("r2", Decision.AFFINITY)


def test_running_prompts_end_are_forgotten_and_bounded():
    running = RunningPrompts(max_requests=2)
    running.started("a", "r1", b"x")
    running.started("b", "r2", b"x")
    assert running.replicas(b"x", ["r1", "r2", "r3"]) == {"r1", "r2"}
    running.ended("a")
    running.ended("a")  # (reported twice: no effect)
    assert running.replicas(b"x", ["r1", "r2"]) == {"r2"}
    running.forget("r2")
    assert running.replicas(b"x", ["r1", "r2"]) == set()
    for n in range(5):
        running.started(f"c{n}", "r3", b"y")
    assert running.replicas(b"y", ["r3"]) == {"r3"}  # the two newest are followed
    running.ended("c4")
    running.ended("c3")
    assert running.replicas(b"y", ["r3"]) == set()


def test_every_picker_gives_a_conversation_the_same_home_whatever_loads_it_sees():
    """Two pickers (each with its own table and its own view of the loads) send a conversation's
    first turn, and a later turn the other has not seen, to one replica while it is within the
    load gap."""
    replicas = [f"r{n}" for n in range(8)]
    first_view = dict.fromkeys(replicas, 0)
    for n in range(64):
        opening = f"conversation {n}, its system prompt. "
        turn = key(opening + "a question", opening)
        second_view = {replica: (7 * i + n) % 9 for i, replica in enumerate(replicas)}  # another picker's loads
        first = choose(turn, PrefixTable(100), first_view, max_load_gap=16)
        second = choose(turn, PrefixTable(100), second_view, max_load_gap=16)
        assert first.replica == second.replica == home_replica(turn.home, replicas)
        assert first.decision is second.decision is Decision.HOME
        first_view[first.replica] += 1


def test_a_replica_that_left_is_forgotten():
    table = PrefixTable(max_blocks=100)
    blocks = prefix_blocks("a prompt that two replicas were sent", BLOCK)
    table.record(blocks, "r1")
    table.record(blocks, "r2")
    table.forget("r1")
    assert table.longest_match(blocks, {"r1", "r2"}) == (len(blocks), ("r2",))
    table.forget("r2")
    assert len(table) == 0


def test_memory_is_bounded_and_a_shared_start_outlives_the_histories_after_it():
    table = PrefixTable(max_blocks=10)
    system = "S" * 16  # two blocks
    for n in range(50):
        table.record(prefix_blocks(system + f"{n:03d}: a history.", BLOCK), f"r{n % 3}")
        assert len(table) <= 10
    assert table.longest_match(prefix_blocks(system, BLOCK), {"r0", "r1", "r2"})[0] == 2
    assert table.longest_match(prefix_blocks(system + "000: a history.", BLOCK), {"r0"})[0] <= 2  # forgotten


def test_no_replica_to_measure_means_load_decides():
    assert choose(key("anything at all here"), PrefixTable(10), {}, 4) == Choice(None, Decision.BY_LOAD)


@pytest.mark.parametrize("leaving", ["r1", "r2", "r3"])
def test_a_replica_leaving_moves_only_the_conversations_whose_home_it_was(leaving):
    replicas = ["r1", "r2", "r3", "r4"]
    openings = [opening_digest(f"conversation {n}") for n in range(200)]
    before = {home: home_replica(home, replicas) for home in openings}
    after = {home: home_replica(home, [r for r in replicas if r != leaving]) for home in openings}
    moved = {home for home in openings if before[home] != after[home]}
    assert moved == {home for home in openings if before[home] == leaving}
