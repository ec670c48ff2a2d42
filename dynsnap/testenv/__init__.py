"""The real local environment tests and the demo run on.

etcd, kube-apiserver and kube-controller-manager on 127.0.0.1, kwok for fake
kubelets, pod sandboxes (real processes in their own namespaces at the pod's IP)
and a stand-in for the Dynamo operator. Sits beside ``controller`` and ``agent``;
used by ``cli`` (demo) and by the tests' session fixtures.
"""
