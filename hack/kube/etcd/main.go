// Command etcd is the etcd server the test control plane runs: the upstream
// etcdmain at the version k8s.io/kubernetes itself requires (see go.mod).
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
