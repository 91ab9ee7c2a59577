-- The policy of tests/cli/test_check_reasons.py: each rule on its own line,
-- one spread over two, so the reasons' file:line can be checked.
local R = require "ferry.rules"

return R.policy {
  name = "reasons",
  R.min_bytes(1024),
  R.exclude_params_and_buffers(),
  R.exclude_modules(
    R.HEAD),
  R.keep_last_layers(1),
  R.forward_only(),
  recompute = "decide", -- forward_only() then gives the reason
  reload = R.prefetch(2),
}
