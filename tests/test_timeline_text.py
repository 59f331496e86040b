"""The text timeline puts every compute slot, labelled by its text form, at its simulated start, and idle
time as '..'; its last line is the label scheme (ir.LABEL_SCHEME)."""
from pipec.compiler.driver import compile_target
from pipec.compiler.emit import format_timeline
from pipec.compiler.ir import LABEL_SCHEME
from pipec.compiler.simulate import simulate


def test_text_timeline_matches_simulation():
    compiled = compile_target("1f1b", {"P": 3, "N": 4})
    result = simulate(compiled.program)
    *rows, legend = format_timeline(result).splitlines()
    assert legend == LABEL_SCHEME
    lanes = [line.split(" | ", 1)[1].split(" ") for line in rows]
    assert all(len(lane) == result.makespan for lane in lanes)
    for rank, slots in enumerate(result.timeline):
        computes = [s for s in slots if not s.is_comm]
        for slot in computes:
            assert lanes[rank][slot.start] == slot.action.text()
            assert all(set(cell) == {"-"} for cell in lanes[rank][slot.start + 1 : slot.end])
        idle = sum(1 for cell in lanes[rank] if set(cell) == {"."})
        assert idle == result.ranks[rank].idle
