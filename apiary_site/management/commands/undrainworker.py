"""`apiary worker undrain ID`: withdraw a drain request (drainworker's --undo)."""

from apiary_site.management.commands import drainworker


class Command(drainworker.Command):
    words = "worker undrain"
    help = "Withdraw a drain request: the worker one that has not exited yet claims again."
    undo = True
