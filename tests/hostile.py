"""Hostile label and taint keys and values (issue 10 item 1), shared by the tests.

Pool labels and taints come from tenants. Each of these, put into a boot payload unescaped,
would add a systemd directive, a shell command, a kubelet flag, a label or a YAML key, or break
the document. None is valid Kubernetes label syntax: the API server (values, taints) or the
bridge (label keys, tgp's own prefixes) refuses every one (tests/test_bridge.py,
tests/test_crds.py); tests/test_bootstrap.py checks the renderer's own defences below that.
"""

HOSTILE_VALUES = [
    "a\nExecStartPre=/bin/sh -c 'id > /tmp/pwned'",
    "x\r\n[Service]\r\nExecStart=/bin/sh",
    'quote"d',
    "single'quote",
    "$(reboot)",
    "`id`",
    "${PATH}",
    "$$",
    "%n%H",
    "{{ 7 * 7 }}",
    "{% raw %}",
    "}}",
    "--register-with-taints=evil:NoSchedule",
    "a,tgp.io/managed=false",
    "k=v",
    "a b",
    "a;reboot",
    "back\\slash",
    "ünïcödé",
    "line\u2028separator",
    "next\x85line",
    "emoji\U0001f600",
    "nul\x00byte",
    "tab\tx",
    "#comment",
    ": colon",
    "- dash",
    "*alias",
    "&anchor",
    "!!python/object/apply:os.system ['id']",
    "---",
    "x" * 64,
    "y" * 5000,
    "-leading",
    "trailing-",
    "a/b/c",
]
# Keys beyond the values above: bad syntax, or tgp's own, a role, or refused by the kubelet.
HOSTILE_KEYS = [
    *HOSTILE_VALUES,
    "",
    "/x",
    "x/",
    "Example.com/upper-prefix",
    "a" * 64,
    "p" * 254 + "/b",
    "tgp.io/managed",
    "sub.tgp.io/x",
    "node-role.kubernetes.io/control-plane",
    "kubernetes.io/custom",
    "foo.k8s.io/bar",
]
