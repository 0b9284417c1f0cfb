"""Elastic state (Horovod's ``State``): commits, restore, sync, interrupts, what a
commit keeps in host memory and writes durably."""
