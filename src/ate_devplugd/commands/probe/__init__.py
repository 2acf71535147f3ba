"""``ate-devplugd probe``: what kubelet (and in DRA mode the scheduler) sees of this node's plugin."""
