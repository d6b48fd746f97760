"""JUnit XML for CI systems: one testcase per (op, candidate); skips and failures carry their reason."""
from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from verify.model.verdict import FAIL, SKIP, XPASS, OpVerdict


def write_junit(verdicts: list[OpVerdict], path: str | Path) -> Path:
    suite = ET.Element("testsuite", name="verify-kernels", tests=str(len(verdicts)),
                       failures=str(sum(v.status in (FAIL, XPASS) for v in verdicts)),
                       skipped=str(sum(v.status == SKIP for v in verdicts)),
                       time=f"{sum(v.seconds for v in verdicts):.3f}")
    for v in verdicts:
        tc = ET.SubElement(suite, "testcase", classname=f"verify_kernels.{v.candidate}", name=v.op,
                           time=f"{v.seconds:.3f}")
        if v.status in (FAIL, XPASS):
            f = ET.SubElement(tc, "failure", message=v.reason[:500])
            f.text = "\n".join(x for x in (v.reason, v.failure.case if v.failure else "", v.repro) if x)
        elif v.status == SKIP:
            ET.SubElement(tc, "skipped", message=v.reason)
        ET.SubElement(tc, "system-out").text = f"cases {v.cases_passed}/{v.cases_run}, worst ratio {v.worst_ratio}"
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(suite).write(p, encoding="utf-8", xml_declaration=True)
    return p
