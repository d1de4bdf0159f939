"""Linux primitives the node's services share: syscalls, cgroups, network namespaces, and the
`process` isolation runtime. One real implementation each; services decide when to call them."""
