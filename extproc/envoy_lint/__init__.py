"""`extproc envoy lint`: check an Envoy config a user already runs against a policy.

It reads an Envoy bootstrap, Istio or Envoy Gateway resources, and reports each trap of
docs/deploy.md ("The facts that matter") with its line and fix. `command` is the CLI entry,
`lint.lint_file` the library one.
"""
