"""Wake-ups for waiting claims: a long-poll waits holding nothing and is
woken when a job may have become claimable for it.

    notifier.py   the waiters of this process and who gets which wake (no database)
    emit.py       services announce wakes inside their transaction (NOTIFY or a row)
    watch.py      one thread per process brings other processes' wakes in

`notifier` is the process's one Notifier; the claim service gives it the
requirement sets it knows (`resolve`).
"""

from .notifier import Notifier, Waiter, Wake

notifier = Notifier()

__all__ = ["Notifier", "Wake", "Waiter", "notifier"]
