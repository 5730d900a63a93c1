"""Progress display for ``quack build``: a Rich live view on a terminal (overall
bar with done/total, keys/s and ETA, one line per running worker, failures as
they happen), one plain line per key otherwise (CI logs). The Console is
injected, so tests and ``--json`` runs choose where it goes."""

from __future__ import annotations

import time

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from quack_build.build.results import (
    CACHED,
    COMPILED,
    FAILED,
    INTERRUPTED,
    REMOTE,
    SHARED,
    SKIPPED,
    BuildResult,
    Task,
)


def _err_line(t: Task) -> str:
    return t.error or "failed"  # the compiler's first error line (scheduler._first_line)


# The line for a key another process holds the lock of: without it a build whose keys
# another build was compiling showed nothing for as long as it waited (90 s seen).
AWAITED = "another process holds its lock (a build or test compiling it); waiting for its entry"


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "?"
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(s), 60)
    return f"{m}m{sec:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m"


class _Base:
    def __init__(self, console: Console, verbose: bool = False):
        self.console = console
        self.verbose = verbose
        self.total = 0
        self.done = 0
        self.ncompile = 0
        self.cached = 0
        self.failed: list[Task] = []
        self.t0 = time.time()
        self.t_first = None
        self.width = 1

    def planned(self, tasks, todo, jobs):
        self.total = len(tasks)
        self.ncompile = len(todo)
        self.cached = len(tasks) - len(todo)
        self.jobs = jobs
        self.width = len(str(self.total))
        self.t0 = time.time()

    def rate(self) -> float | None:
        el = time.time() - self.t0
        return self.done / el if self.done and el > 0 else None

    def eta(self) -> float | None:
        r = self.rate()
        return (self.ncompile - self.done) / r if r else None

    def note(self, text):
        # soft_wrap: one key, one line, however long its error (a CI log is read per line)
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def tick(self):
        pass

    def close(self):
        pass


class PlainReporter(_Base):
    """One line per key: for CI logs (no cursor movement, no colour)."""

    def planned(self, tasks, todo, jobs):
        super().planned(tasks, todo, jobs)
        self.note(
            f"quack build: {len(tasks)} configurations, {self.cached} cached, "
            f"{len(todo)} to compile with {jobs} worker{'s' if jobs != 1 else ''}"
        )
        if self.verbose:
            for t in tasks:
                if t.status == CACHED:
                    self.note(f"[{'-' * self.width}/{self.total}] cached    {t.cfg.label()}")

    def started(self, task):
        if task.awaited:  # always: the build may wait here for minutes (lock_timeout)
            self.note(f"[{'.' * self.width}/{self.total}] waiting   {task.cfg.label()}  {AWAITED}")
        elif self.verbose:
            self.note(f"[{'.' * self.width}/{self.total}] start     {task.cfg.label()}")

    def finished(self, t: Task):
        self.done += 1
        n = f"[{self.done:>{self.width}}/{self.ncompile}]"
        if t.status == FAILED:
            self.failed.append(t)
            self.note(f"{n} FAILED    {t.cfg.label()}  {t.wall_s:.2f}s: {_err_line(t)}")
        else:
            word = "compiled " if t.status == COMPILED else "cached*  "
            who = "another process" if t.awaited else t.lane or f"worker {t.pid}"
            self.note(
                f"{n} {word} {t.cfg.label()}  {t.compile_s if t.status == COMPILED else t.wall_s:.2f}s "
                f"({who})"
            )


class LiveReporter(_Base):
    """Rich live view: overall bar, one line per running worker, failures printed above."""

    def __init__(self, console: Console, verbose: bool = False):
        super().__init__(console, verbose)
        self.running: dict[int, Task] = {}
        self.waiting: dict[str, Task] = {}  # by key: awaited on another process's lock
        self.live: Live | None = None

    def planned(self, tasks, todo, jobs):
        super().planned(tasks, todo, jobs)
        self.console.print(
            f"[bold]quack build[/]: {len(tasks)} configurations, [green]{self.cached} cached[/], "
            f"[cyan]{len(todo)} to compile[/] with {jobs} worker{'s' if jobs != 1 else ''}"
        )
        if todo:
            self.live = Live(
                get_renderable=self._render, console=self.console, refresh_per_second=8, transient=True
            )
            self.live.start()

    def started(self, task):
        # A key started again (retried on a new worker, or compiled here after another
        # process let go of it) leaves its old row.
        self.waiting.pop(task.cfg.key, None)
        for slot in [s for s, t in self.running.items() if t is task]:
            del self.running[slot]
        if task.awaited:
            self.waiting[task.cfg.key] = task
        else:
            self.running[task.slot] = task

    def finished(self, t: Task):
        self.done += 1
        self.running.pop(t.slot, None)
        self.waiting.pop(t.cfg.key, None)
        if t.status == FAILED:
            self.failed.append(t)
            self.console.print(f"[red]FAILED[/] {escape(t.cfg.label())}: {escape(_err_line(t))}")
        elif self.verbose:
            self.console.print(f"[green]done[/] {escape(t.cfg.label())} {t.compile_s:.2f}s")

    def _render(self):
        frac = self.done / self.ncompile if self.ncompile else 1.0
        width = 40
        filled = int(frac * width)
        bar = Text("━" * filled, style="green") + Text("━" * (width - filled), style="grey37")
        rate = self.rate()
        head = Text.assemble(
            ("compiling ", "bold"),
            bar,
            f" {self.done}/{self.ncompile}",
            f"  {rate:.2f} keys/s" if rate else "  -- keys/s",
            f"  elapsed {_fmt_s(time.time() - self.t0)}",
            f"  ETA {_fmt_s(self.eta())}",
            (f"  {len(self.failed)} failed", "red") if self.failed else "",
        )
        rows = Table.grid(padding=(0, 1))
        now = time.time()
        for slot in sorted(self.running):
            t = self.running[slot]
            rows.add_row(
                Text(f"  worker {slot + 1:>2}", style="dim"),
                Text(t.cfg.label(), overflow="ellipsis", no_wrap=True),
                Text(_fmt_s(now - t.start), style="cyan"),
            )
        for t in self.waiting.values():
            rows.add_row(
                Text("  waiting  ", style="yellow"),
                Text(f"{t.cfg.label()}: {AWAITED}", overflow="ellipsis", no_wrap=True),
                Text(_fmt_s(now - t.start), style="yellow"),
            )
        return Group(head, rows)

    def tick(self):
        pass

    def close(self):
        if self.live is not None:
            self.live.stop()
            self.live = None


def make_reporter(console: Console, *, verbose: bool = False, quiet: bool = False):
    if quiet:
        from quack_build.build.results import NullReporter

        return NullReporter()
    if console.is_terminal and not console.is_dumb_terminal:
        return LiveReporter(console, verbose)
    return PlainReporter(console, verbose)


def summary_table(res: BuildResult) -> Table:
    eff = res.efficiency
    compiled = res.count(COMPILED)
    shared = res.count(SHARED)
    failed = res.count(FAILED)
    not_built = res.count(SKIPPED) + res.count(INTERRUPTED)
    tbl = Table(title="quack build summary", show_header=False, box=None, padding=(0, 2))
    tbl.add_column(style="bold")
    tbl.add_column(justify="right")
    tbl.add_row("configurations", str(len(res.tasks)))
    tbl.add_row("compiled", f"[green]{compiled}[/]" if compiled else "0")
    tbl.add_row(
        "cached",
        str(res.count(CACHED) + shared) + (f" ({shared} built by another process)" if shared else ""),
    )
    stored = sum(1 for t in res.tasks if t.status == FAILED and t.failure == "store")
    tbl.add_row(
        "failed",
        (f"[red]{failed}[/]" + (f" ({stored} compiled, failed to store)" if stored else ""))
        if failed
        else "0",
    )
    if not_built:
        tbl.add_row("not built", f"[yellow]{not_built}[/]")
    if res.remote_url:
        r = res.remote
        tbl.add_row(
            "remote",
            escape(res.remote_url) + (" [yellow](off: unreachable)[/]" if res.remote_offline else ""),
        )
        tbl.add_row("  remote hits", str(res.count(REMOTE)))
        tbl.add_row(
            "  remote pushed",
            str(r.get("pushed", 0))
            + (f" ({r['push_exists']} already there)" if r.get("push_exists") else ""),
        )
        rej = r.get("rejected", 0)
        reasons = ", ".join(f"{k} {v}" for k, v in sorted((r.get("rejected_by_reason") or {}).items()))
        tbl.add_row("  remote rejected", f"[red]{rej}[/] ({reasons})" if rej else "0")
        if r.get("replaced"):
            why = ", ".join(f"{k} {v}" for k, v in sorted((r.get("replaced_by_reason") or {}).items()))
            tbl.add_row("  remote replaced", f"[yellow]{r['replaced']}[/] refused objects ({why})")
        if r.get("push_failed"):
            tbl.add_row("  remote push failed", f"[yellow]{r['push_failed']}[/]")
        if r.get("push_skipped"):
            tbl.add_row(
                "  remote push skipped",
                f"[yellow]{r['push_skipped']}[/] (not tried: pushing was off after a failure)",
            )
        if r.get("errors"):
            tbl.add_row("  remote errors", f"[yellow]{r['errors']}[/]")
    if res.tune_gpu[1]:
        models, why = res.tune_gpu
        tbl.add_row(
            "tuning rows for",
            escape(f"GPU {', '.join(models)} ({why})" if models else f"each table default GPU ({why})"),
        )
    tbl.add_row("compile time (sum)", f"{res.compile_s:.1f} s")
    tbl.add_row("wall time", f"{res.wall_s:.1f} s")
    if compiled and res.compile_wall_s > 0:
        tbl.add_row("throughput", f"{compiled / res.compile_wall_s:.2f} keys/s")
    if eff is not None:
        tbl.add_row(
            "parallel efficiency", f"{eff * 100:.0f}% of {res.jobs} worker{'s' if res.jobs != 1 else ''}"
        )
    return tbl


def _print_failed(console: Console, failed: list[Task], what: str) -> None:
    if not failed:
        return
    console.print(f"[red bold]{len(failed)} configuration{'s' if len(failed) != 1 else ''} {what}:[/]")
    for t in failed[:20]:
        console.print(
            f"  [red]x[/] {escape(t.cfg.label())}  (key {t.cfg.key[:16]})\n      {escape(_err_line(t))}",
            highlight=False,
            soft_wrap=True,
        )
    if len(failed) > 20:
        console.print(f"  ... and {len(failed) - 20} more")


def print_summary(console: Console, res: BuildResult) -> None:
    console.print(summary_table(res))
    if res.pool_start_s:
        what = (
            "Ray start-up (connect, ship code, actor import + warm-up compile)"
            if res.executor == "ray"
            else "worker start-up (forkserver import + warm-up compile)"
        )
        pre = ""
        if res.preload:
            pre = f" (of it preload {', '.join(res.preload)}: {res.preload_s:.1f}s)"
        console.print(
            f"{what}: {res.pool_start_s:.1f}s{pre}; compile phase {res.compile_wall_s:.1f}s", markup=False
        )
    failed = [t for t in res.tasks if t.status == FAILED]
    # A key the cache could not take (disk full, read-only) compiled: "failed to compile"
    # sent readers to the kernel's code for what the cache's disk did.
    _print_failed(
        console, [t for t in failed if t.failure not in ("store", "lock", "no_worker")], "failed to compile"
    )
    _print_failed(console, [t for t in failed if t.failure == "store"], "compiled but failed to store")
    _print_failed(
        console,
        [t for t in failed if t.failure == "lock"],
        "not built: another process held the lock past lock_timeout",
    )
    _print_failed(
        console,
        [t for t in failed if t.failure == "no_worker"],
        "not built: no worker left (the executor lost every one it could start)",
    )
    if failed and res.log_path:  # only a log that holds something (failures.log_with_content)
        what = "full compiler output" if any(t.failure == "compile" for t in failed) else "full error text"
        console.print(f"{what}: {escape(res.log_path)}", highlight=False)
    skipped = [t for t in res.tasks if t.status == SKIPPED]
    if skipped and not res.interrupted:
        console.print(
            f"[yellow bold]{len(skipped)} configuration{'s' if len(skipped) != 1 else ''} not built[/]"
            + (" (the build stopped at the first failure; --keep-going builds the rest):" if failed else ":")
        )
        for t in skipped[:20]:
            console.print(f"  [yellow]-[/] {escape(t.cfg.label())}  (key {t.cfg.key[:16]})", highlight=False)
        if len(skipped) > 20:
            console.print(f"  ... and {len(skipped) - 20} more")
    if res.interrupted:
        # Said from what the sweep found after it, not assumed: it used to say "no partial
        # entries were left" while the temp files of two killed workers were still there.
        n = len(res.partial_left)
        left = (
            "no partial entries were left"
            if not n
            else f"{n} partial file{'s' if n != 1 else ''} left, which `quack cache clean` removes "
            f"once the writer has ended"
        )
        console.print(
            f"[yellow]interrupted[/]: {res.count(COMPILED)} compiled before the stop; "
            f"{res.count(INTERRUPTED)} not built ({left})"
        )
        for path in res.partial_left[:5]:
            console.print(f"  [yellow]-[/] {escape(path)}", highlight=False)
        if n > 5:
            console.print(f"  ... and {n - 5} more")
    elif res.missing_after and not failed:
        console.print(f"[red]{len(res.missing_after)} configurations are not in the cache after the build[/]")
