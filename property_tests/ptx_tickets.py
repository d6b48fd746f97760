"""Where a one-launch kernel's PTX draws and waits on its gpu-scope ticket counter (the tests of
fused/*_onelaunch.py and fused/router_topk_latent_down.py read the order of fences and atomics from it).

The scope left out of a PTX atomic is .gpu (its default); a .cta ticket would not see other CTAs' writes."""
import re

TICKET = r"atom(?:\.global)?\.acq_rel(?:\.gpu)?(?:\.global)?\.add\.u32"    # the draw: acq_rel add
WAIT = r"atom(?:\.global)?\.acquire(?:\.gpu)?(?:\.global)?\.add\.u32"      # a wait's read: acquire add of 0


def kernel_body(ptx: str) -> str:
    """The PTX from its (first) kernel entry on."""
    return ptx[ptx.index(".entry"):]


def sites(body: str, pattern: str) -> list[int]:
    """Offsets in `body` of every instruction matching `pattern`."""
    return [m.start() for m in re.finditer(pattern, body)]


def assert_one_ticket_between_fences(ptx: str, ptxas_regs) -> None:
    """One ticket, a gpu-scope acq_rel fence before it (the CTA's writes released) and one after it (the
    last CTA's reads acquired), and no register spills when assembled for sm_90a."""
    body = kernel_body(ptx)
    tickets = sites(body, TICKET)
    assert len(tickets) == 1, tickets
    assert "fence.acq_rel.gpu" in body[:tickets[0]] and "fence.acq_rel.gpu" in body[tickets[0]:]
    assert_no_spills(ptx, ptxas_regs)


def assert_no_spills(ptx: str, ptxas_regs) -> None:
    regs, spills = ptxas_regs(ptx)
    assert spills == 0 and regs <= 255, (regs, spills)
