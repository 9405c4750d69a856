"""The C++ lane loop's scheduling works on statement records (their uses and flags), never on their
text: the pipelined param write-back, the first pass of torch's square roots, the closure of a value."""

from __future__ import annotations

from lowbit_compile.kernels.cpp_layout import LaneBody, Stmt


def _adam_like(text: str = "") -> LaneBody:
    """g and m loaded, m's new value stored early; the denominator (a square root) and the update feed
    only the param's write-back. ``text`` replaces every statement's C++, which must change nothing."""
    def stmt(default: str, *args, **kw) -> Stmt:
        return Stmt(text or default, *args, **kw)

    values = [
        stmt("const vf v_g = lb_ld(p_g + i);", "v_g", ctype="vf", indexed=True),
        stmt("vf v_m = lb_decode(...);", "v_m", ctype="vf", indexed=True),
        stmt("const vf v_m1 = v_m + v_g;", "v_m1", frozenset({"v_m", "v_g"}), "vf"),
        stmt("const vf v_den = lb_sqrt(v_m1);", "v_den", frozenset({"v_m1"}), "vf", slow=True, root_of="v_m1"),
        stmt("const vi v_big = v_g > v_den;", "v_big", frozenset({"v_g", "v_den"}), "vi"),
        stmt("const vf v_upd = v_big ? v_m1 : v_den;", "v_upd", frozenset({"v_big", "v_m1", "v_den"}), "vf"),
    ]
    stores = [stmt("lb_st(buf_m + i, v_m1);", uses=frozenset({"v_m1"}))]
    late = [stmt("lb_st(p_p + i, v_upd);", uses=frozenset({"v_upd"}))]
    return LaneBody(values, stores, late)


def test_the_param_write_back_and_what_only_it_needs_run_late_carrying_what_the_early_part_computed():
    piped = _adam_like().pipelined()
    assert piped is not None
    assert [s.defines for s in piped.early] == ["v_g", "v_m", "v_m1", None]
    assert [s.defines for s in piped.late] == ["v_den", "v_big", "v_upd", None]
    assert piped.carried == [("vf", "v_g"), ("vf", "v_m1")]


def test_the_schedule_ignores_the_statements_text():
    assert _adam_like().pipelined() == _adam_like().pipelined()
    renamed = _adam_like("/* any text */").pipelined()
    assert [s.defines for s in renamed.late] == ["v_den", "v_big", "v_upd", None]
    assert renamed.carried == [("vf", "v_g"), ("vf", "v_m1")]


def test_nothing_moves_without_a_long_latency_op_to_hide():
    body = _adam_like()
    body.values = [s if s.defines != "v_den" else Stmt(s.text, s.defines, s.uses, s.ctype) for s in body.values]
    assert body.pipelined() is None


def test_a_value_an_early_write_back_needs_stays_early():
    body = _adam_like()
    body.stores.append(Stmt("lb_st(buf_v + i, v_big);", uses=frozenset({"v_big"})))
    assert body.pipelined() is None  # the square root stays early with v_big; only v_upd would move


def test_the_first_pass_computes_only_what_the_square_root_inputs_need():
    body = _adam_like()
    store = Stmt("lb_st(sq0 + i, v_m1);", uses=frozenset({"v_m1"}))
    assert [s.defines for s in body.first_pass({"v_sq0"}, [store])] == ["v_g", "v_m", "v_m1", None]
    assert body.closure({"v_upd"}) == {"v_g", "v_m", "v_m1", "v_den", "v_big", "v_upd"}
    assert body.first_pass({"v_den"}, [Stmt("lb_st(sq1 + i, v_upd);", uses=frozenset({"v_upd"}))]) is None
