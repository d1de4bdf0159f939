"""MicroVMs on a node: QEMU's command line and process (machine.py), the guest it boots
(guest_image.py: Debian's kernel, our initramfs and the C agent in guest/), the image files
that become its disks (layer_disks.py), the agent's wire (frames.py) and the node's end of it
(channel.py), QMP (qmp.py), and starting VMs from saved machine states (runtime.py)."""
