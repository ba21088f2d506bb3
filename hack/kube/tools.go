//go:build tools

// Package kube pins the test control plane's binaries: the commands are built
// with `go build k8s.io/kubernetes/cmd/<name>` from this module (see Makefile,
// target kube), and etcd from ./etcd.
package kube

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
)
