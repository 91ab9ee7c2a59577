-- ferry check's answers for optimizer states and weights (test_check_json.py)
local R = require "ferry.rules"
return R.policy {
  name = "resident",
  R.min_bytes(1024),
  optimizer = { R.device_below(2^16),
                R.host_fraction(0.5) },
  weights = R.host_first_layers(1),
}
