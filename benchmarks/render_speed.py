"""Render speed: how long each drawing of interleaved 1F1B takes, up to 64 ranks x 512 microbatches.

For each size, times compile + check, simulate, and writing each form
(.svg, .html, .json, .dot), prints the file sizes and microseconds per box, and,
with ``--browser``, how long headless Chromium takes to open the HTML page and
take its screenshot (the page is drawn by then). The issue's bar: the 64 x 512
timeline renders in under 10 seconds, compile and simulation included, and
opens in a browser.

Usage: python benchmarks/render_speed.py [--sizes 8x64x2,64x512x2] [--browser] [--keep DIR]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time

DEFAULT_SIZES = [(8, 64, 2), (16, 128, 2), (32, 256, 2), (64, 512, 2)]
FORMS = (".svg", ".html", ".json", ".dot")
BAR_SECONDS = 10.0


def open_in_chromium(page: str, folder: str) -> float:
    """Seconds for headless Chromium to load ``page`` and screenshot it (1200 x 800)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("--browser needs chromium (Debian: apt-get install chromium)")
    png = os.path.join(folder, "shot.png")
    command = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={os.path.join(folder, 'profile')}", f"--screenshot={png}",
               "--window-size=1200,800", "file://" + os.path.abspath(page)]
    start = time.perf_counter()
    subprocess.run(command, capture_output=True, timeout=300)
    elapsed = time.perf_counter() - start
    if not os.path.exists(png):
        raise SystemExit(f"chromium wrote no screenshot of {page}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join("x".join(map(str, s)) for s in DEFAULT_SIZES))
    parser.add_argument("--browser", action="store_true", help="also open each HTML page in headless Chromium")
    parser.add_argument("--keep", metavar="DIR", help="write the drawings here (default: a temporary folder)")
    args = parser.parse_args()
    sizes = [tuple(int(x) for x in item.split("x")) for item in args.sizes.split(",")]

    from pipec.compiler.driver import compile_target
    from pipec.compiler.render import write_graph, write_timeline
    from pipec.compiler.simulate import simulate

    folder = args.keep or tempfile.mkdtemp(prefix="pipec-render-")
    os.makedirs(folder, exist_ok=True)
    header = (f"{'P':>3} {'N':>4} {'v':>2} {'boxes':>7} | {'compile':>7} {'sim':>5} | "
              + " ".join(f"{form:>6}" for form in FORMS) + " | " + " ".join(f"{form + ' MB':>8}" for form in FORMS)
              + f" | {'us/box':>6} {'total':>6}" + (f" | {'browser':>7}" if args.browser else ""))
    print(header)
    print("-" * len(header))
    worst = 0.0
    for P, N, v in sizes:
        start = time.perf_counter()
        program = compile_target("interleaved_1f1b", {"P": P, "N": N, "v": v}).program
        compiled = time.perf_counter()
        result = simulate(program)
        simulated = time.perf_counter()
        boxes = sum(1 for lane in result.timeline for slot in lane if not slot.is_comm)
        seconds, sizes_mb = [], []
        for form in FORMS:
            path = os.path.join(folder, f"interleaved_{P}x{N}{form}")
            began = time.perf_counter()
            if form == ".dot":
                write_graph(program, path)
            else:
                write_timeline(result, program, path)
            seconds.append(time.perf_counter() - began)
            sizes_mb.append(os.path.getsize(path) / 1e6)
        # the bar: one timeline form from nothing (compile + simulate + the slower of SVG and HTML)
        total = (compiled - start) + (simulated - compiled) + max(seconds[0], seconds[1])
        worst = max(worst, total)
        line = (f"{P:>3} {N:>4} {v:>2} {boxes:>7} | {compiled - start:>7.2f} {simulated - compiled:>5.2f} | "
                + " ".join(f"{s:>6.2f}" for s in seconds) + " | " + " ".join(f"{mb:>8.1f}" for mb in sizes_mb)
                + f" | {max(seconds[0], seconds[1]) / boxes * 1e6:>6.2f} {total:>6.2f}")
        if args.browser:
            line += f" | {open_in_chromium(os.path.join(folder, f'interleaved_{P}x{N}.html'), folder):>7.2f}"
        print(line, flush=True)
    print(f"\nslowest timeline from nothing: {worst:.2f} s (bar: {BAR_SECONDS:.0f} s); drawings in {folder}")
    if worst >= BAR_SECONDS:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
