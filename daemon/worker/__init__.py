"""Worker mode: claim, run on own slots and GPUs, heartbeat, hand outcomes back."""
