"""The compile pool's modules (pool, worker, tasks, external, scope): what is sent to
a worker is pickled by reference to its home; the per-key book keeps its rules (stale outcomes dropped, a pending key never forgotten, a shutdown
fails what is pending without counting it as a failure, the session's errors outlive forget)."""

import pickle

from quack.compile import tasks, worker
from quack.errors import CompileError


def test_worker_task_is_pickled_by_reference_to_the_worker_module():
    req = worker.WorkerRequest("m", "k", {"n": 1}, "sm_90a", "/tmp/c", False, 5.0)
    blob = pickle.dumps((worker.worker_build, req))
    assert b"quack.compile.worker" in blob and b"worker_build" in blob
    fn, back = pickle.loads(blob)
    assert fn is worker.worker_build and back == req


def _task(book, key="k1"):
    req = worker.WorkerRequest("m", "kern", {}, "sm_90a", "/c", False, 5.0)
    t = tasks.Task(("/c", key), key, "/c", "kern", {}, "sm_90a", req, 30.0)
    book.begin(t)
    return t


def test_book_records_outcomes_of_the_current_task_only():
    book = tasks.TaskBook()
    old = _task(book)
    new = _task(book)  # submitted again: the first task's outcome is stale
    assert book.state(("/c", "k1")) == tasks.PENDING
    assert book.finish(old, True, {"compiled": True, "compile_s": 1.0}) is False
    assert book.counts["done"] == 0 and book.state(("/c", "k1")) == tasks.PENDING
    assert book.finish(new, True, {"compiled": True, "compile_s": 2.5}) is True
    assert book.poll(("/c", "k1")) == (tasks.DONE, None)
    assert (book.counts["done"], book.counts["compiled"], book.counts["compile_s"]) == (1, 1, 2.5)
    assert book.report(("/c", "k1")) == {"compiled": True, "compile_s": 2.5}
    info = book.task(("/c", "k1")).info()
    assert (info.kernel, info.key, info.external, info.pid) == ("kern", "k1", False, None)


def test_book_never_forgets_a_pending_key_and_cancel_is_not_a_failure():
    book = tasks.TaskBook()
    t = _task(book)
    book.forget(("/c", "k1"))
    assert book.state(("/c", "k1")) == tasks.PENDING and book.task(("/c", "k1")) is t
    book.cancel(t)
    st, err = book.poll(("/c", "k1"))
    assert st == tasks.FAILED and isinstance(err, CompileError) and "shut down" in str(err)
    assert book.counts["failed"] == 0
    assert book.error_texts() == {}  # not a failure: neither counted nor listed
    book.forget(("/c", "k1"))
    assert book.poll(("/c", "k1")) == (tasks.NEW, None) and book.task(("/c", "k1")) is None


def test_book_failure_and_renew():
    book = tasks.TaskBook()
    t = _task(book)
    died = tasks.worker_died_error(t, -9)
    assert "SIGKILL" in str(died) and died.transient
    assert book.finish(t, False, died) is True
    assert book.poll(("/c", "k1")) == (tasks.FAILED, died) and book.counts["failed"] == 1
    t2 = _task(book, "k2")
    assert book.pending() == 1
    book.renew(("/c", "k2"))  # the other process let go without publishing: new again
    assert book.state(("/c", "k2")) == tasks.NEW and book.task(("/c", "k2")) is None
    assert book.finish(t2, True, {}) is False


def test_book_keeps_the_sessions_errors_after_forget_and_bounds_them(monkeypatch):
    """A failure is reported once and then forgotten (so the key may be retried); the
    session's record of it stays, one line that says why, for the pytest plugin's summary
    (it read the errors after the tests had consumed them, and listed none)."""
    book = tasks.TaskBook()
    detail = 'Traceback (most recent call last):\n  File "k.py", line 3\nValueError: n must be even\n'
    t = _task(book)
    assert book.finish(t, False, CompileError("kern", {"n": 3}, "sm_90a", detail)) is True
    book.forget(("/c", "k1"))
    assert book.poll(("/c", "k1")) == (tasks.NEW, None)
    assert book.error_texts() == {
        "k1": "compiling kern {'n': 3} for sm_90a failed: ValueError: n must be even"
    }
    monkeypatch.setattr(tasks, "MAX_SESSION_ERRORS", 3)
    for i in range(2, 6):
        book.finish(_task(book, f"k{i}"), False, CompileError("kern", {"n": i}, "sm_90a", "error: bad"))
    assert list(book.error_texts()) == ["k1", "k2", "k3"] and book.counts["failed"] == 5
    book.finish(_task(book), False, CompileError("kern", {"n": 3}, "sm_90a", "error: worse"))
    assert book.error_texts()["k1"].endswith("error: worse")  # a key's latest error, still kept
