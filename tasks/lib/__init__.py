"""What the controller's commands share, none of them a task: the playbook runner, the inventory,
SSH connections, the status probe, cluster targets and the checkout's common helpers."""
