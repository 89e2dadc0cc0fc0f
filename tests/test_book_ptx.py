"""PTX tools of chapter 3 (rqlib.book.ptx) on hand-written PTX, and once on the real compile
of the fused-score kernel for sm_90, so that the chapter's markers are checked against what
Triton emits today."""

import pytest

from rqlib.book import ptx

LOOP = [
    "$L__BB0_1:",
    "    ret;",
    "$L__BB0_2:                              // =>This Inner Loop Header: Depth=1",
    "\t.loc\t1 7 0                          // kern.py:7:0",
    "    cp.async.wait_group     2;",
    "    ld.shared.b32     %r1, [%r9];",
    "    ld.shared.b32     %r2, [%r9+4];",
    "    ld.shared.b32     %r3, [%r9+8];",
    "    fma.rn.f32     %r4, %r1, %r2, %r3;",
    "    fma.rn.f32     %r5, %r1, %r2, %r4;",
    "\t.loc\t1 9 0                          // kern.py:9:0",
    "    mov.u16 %rs1, 0x0;",
    "    @%p1 ld.global.b8 { %rs1 }, [ %rd1 + 0 ];",
    "    mov.u16 %rs2, 0x0;",
    "    @%p2 ld.global.b8 { %rs2 }, [ %rd2 + 0 ];",
    "",
    "    // begin inline asm",
    "    @%p3 bra     $L__BB0_2;",
    "$L__BB0_3:",
]
SOURCE = (
    "line one\nline two\nline three\nline four\nline five\nline six\nq = tl.load(x)\n"
    "line eight\nhi = tl.load(y)\n"
)


@pytest.fixture
def source_dir(tmp_path):
    (tmp_path / "kern.py").write_text(SOURCE)
    return tmp_path


def test_inner_loop_runs_from_the_header_to_its_back_edge():
    loop = ptx.inner_loop(LOOP)
    assert loop[0].startswith("$L__BB0_2:") and loop[-1].strip() == "@%p3 bra     $L__BB0_2;"
    with pytest.raises(LookupError, match="Inner Loop Header"):
        ptx.inner_loop(LOOP[:2])
    with pytest.raises(LookupError, match="back edge"):
        ptx.inner_loop(LOOP[:-2])


def test_annotate_names_each_source_line_once(source_dir):
    shown = ptx.annotate(ptx.inner_loop(LOOP), source_dir)
    assert "    // kern.py:7  q = tl.load(x)" in shown
    assert "    // kern.py:9  hi = tl.load(y)" in shown
    assert not any("inline asm" in line or not line.strip() for line in shown)
    with pytest.raises(FileNotFoundError, match="kern.py"):
        ptx.annotate(LOOP, source_dir / "elsewhere")


def test_fold_marks_repeated_blocks():
    folded = ptx.fold(["ld.shared.b32 a;", "ld.shared.b32 b;", "ld.shared.b32 c;", "ret;"])
    assert folded[0].startswith("ld.shared.b32 a;") and folded[0].endswith("// x3")
    assert folded[1] == "ret;"
    pairs = ["mov.u16 a;", "@%p1 ld.global.b8 b;", "mov.u16 c;", "@%p2 ld.global.b8 d;"]
    folded = ptx.fold(pairs)
    assert folded[0] == "mov.u16 a;" and folded[1].endswith("// these 2 lines x2")
    assert len(folded) == 2
    assert ptx.opcode("@%p1 ld.global.b8 b;") == "ld.global.b8"
    assert ptx.opcode("// a comment") is None and ptx.opcode("$L__tmp1:") is None


def test_counts_and_excerpt(source_dir):
    loop = ptx.inner_loop(LOOP)
    counts = ptx.loop_counts(loop)
    assert counts == {"lines": len(loop), "fma": 2, "byte_loads": 2, "async_copies": 0}
    body = ptx.fold(ptx.annotate(loop, source_dir))
    excerpt = ptx.loop_excerpt(body)
    assert excerpt[0] == body[0] and "    ..." in excerpt
    assert excerpt[excerpt.index("    ...") + 1] == "    // kern.py:9  hi = tl.load(y)"
    with pytest.raises(LookupError, match="'nowhere' \\(tail\\)"):
        ptx.loop_excerpt(body, tail="nowhere")


def test_the_chapter_markers_hold_on_the_compiled_scores_kernel():
    """Chapter 3's excerpt of the real sm_90 PTX: every marker is found (a kernel rewrite that
    removes one fails here, not in the book build)."""
    from rqlib.kernels import aot, triton_scores

    spec = next(
        s for s in aot.specializations() if s.kernel == "fused_scores_kernel" and not s.ones
    )
    compiled = ptx.compile_ptx(spec.label, 90)
    assert compiled.registers > 0 and compiled.lines
    loop = ptx.inner_loop(compiled.lines)
    from pathlib import Path

    body = ptx.fold(ptx.annotate(loop, Path(triton_scores.__file__).parent))
    excerpt = ptx.loop_excerpt(body)
    assert len(excerpt) < len(body)
    assert ptx.loop_counts(loop)["fma"] > 0
    with pytest.raises(RuntimeError, match="no specialization"):
        ptx.compile_ptx("no such kernel[]", 90)
