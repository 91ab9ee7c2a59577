/* test_snapshot_readers.c — archives that readers accept at the edges:
 * ZIP64 (above 65535 entries, past 4 GiB) and torch.load. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_device.h"
#include "test_snapshot_fixture.h"

/* ZIP64: the entry count above 65535 needs the ZIP64 end records; sizes and
 * offsets past 4 GiB are exercised with the threshold lowered, so that every
 * entry, offset and the central directory go through the ZIP64 fields. */
TEST(snapshot_zip64) {
  fixture f;
  ferry_config c = fixture_config(&f);
  CHECK_OK(fixture_open(&f, &c));
  char dir[64], path[128];
  CHECK(make_dir(dir, sizeof dir) == 0);

  snprintf(path, sizeof path, "%s/many.pt", dir);
  state st;
  CHECK(state_make(&st, 70000, size_tiny, 2, 91) == 0);
  ferry_snapshot *s = NULL;
  CHECK_OK(ferry_snapshot_start(f.e, path, st.rec, st.n, NULL, &s));
  CHECK_OK(ferry_snapshot_fence(s, NULL));
  CHECK_OK(ferry_snapshot_wait(s));
  ferry_snapshot_free(s);
  CHECK(check_archive(dir, path, &st) == 0);
  state_free(&st);

  snprintf(path, sizeof path, "%s/zip64.pt", dir);
  CHECK(state_make(&st, 20, size_random, 4, 92) == 0);
  zipw_set_zip64_threshold(1000);
  int rc = ferry_snapshot_start(f.e, path, st.rec, st.n, NULL, &s);
  if (!rc) rc = ferry_snapshot_wait(s);
  ferry_snapshot_free(s);
  zipw_set_zip64_threshold(0); /* back to the spec's */
  CHECK_OK(rc);
  CHECK(check_archive(dir, path, &st) == 0);
  state_free(&st);
  ferry_engine_destroy(f.e);
  remove_dir(dir);
  return 0;
}

/* torch.load reads an archive whose pickle record came from torch.save and
 * whose tensor bytes came from the device through the snapshot. */
static const char torch_pickle_py[] =
    "import io, sys, zipfile, torch\n"
    "buf = io.BytesIO()\n"
    "torch.save({'w': torch.zeros(1000, dtype=torch.float32), 'step': 7}, buf)\n"
    "with zipfile.ZipFile(buf) as z:\n"
    "    pkl = [n for n in z.namelist() if n.endswith('/data.pkl')][0]\n"
    "    open(sys.argv[1], 'wb').write(z.read(pkl))\n";

static const char torch_load_py[] =
    "import sys, torch\n"
    "obj = torch.load(sys.argv[1])\n"
    "want = torch.arange(1000, dtype=torch.float32) * 0.5\n"
    "assert obj['step'] == 7, obj\n"
    "assert torch.equal(obj['w'], want), obj['w'][:5]\n"
    "print('torch.load ok (torch %s)' % torch.__version__)\n";

TEST(snapshot_torch_load) {
  if (system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0) {
    printf("  skipped: /usr/bin/python3 cannot import torch (apt install python3-torch)\n");
    return 0;
  }
  fixture f;
  ferry_config c = fixture_config(&f);
  CHECK_OK(fixture_open(&f, &c));
  char dir[64], script[128], pkl[128], cmd[512];
  CHECK(make_dir(dir, sizeof dir) == 0);
  snprintf(script, sizeof script, "%s/make_pickle.py", dir);
  snprintf(pkl, sizeof pkl, "%s/data.pkl", dir);
  FILE *fp = fopen(script, "w");
  CHECK(fp);
  fputs(torch_pickle_py, fp);
  fclose(fp);
  snprintf(cmd, sizeof cmd, "/usr/bin/python3 '%s' '%s'", script, pkl);
  CHECK(system(cmd) == 0);
  unsigned char pickle[65536];
  fp = fopen(pkl, "rb");
  CHECK(fp);
  size_t plen = fread(pickle, 1, sizeof pickle, fp);
  fclose(fp);
  CHECK(plen > 0 && plen < sizeof pickle);

  float w[1000];
  for (int i = 0; i < 1000; i++) w[i] = (float)i * 0.5f;
  void *dev = test_dev_malloc(sizeof w);
  test_dev_write(dev, w, sizeof w);
  ferry_snapshot_record rec[] = {
      {.name = "archive/data.pkl", .host_data = pickle, .bytes = plen},
      {.name = "archive/data/0", .device_ptr = dev, .bytes = sizeof w},
      {.name = "archive/version", .host_data = "3\n", .bytes = 2},
  };
  snprintf(script, sizeof script, "%s/load.py", dir);
  fp = fopen(script, "w");
  CHECK(fp);
  fputs(torch_load_py, fp);
  fclose(fp);
  for (int zip64 = 0; zip64 < 2; zip64++) {
    char path[128];
    snprintf(path, sizeof path, "%s/ckpt%d.pt", dir, zip64);
    if (zip64) zipw_set_zip64_threshold(1);
    ferry_snapshot *s = NULL;
    int rc = ferry_snapshot_start(f.e, path, rec, 3, NULL, &s);
    if (!rc) rc = ferry_snapshot_wait(s);
    ferry_snapshot_free(s);
    zipw_set_zip64_threshold(0);
    CHECK_OK(rc);
    /* Overwrite the device tensor: the file must not depend on it now. */
    memset(w, 0, sizeof w);
    test_dev_write(dev, w, sizeof w);
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 '%s' '%s'", script, path);
    CHECK(system(cmd) == 0);
    for (int i = 0; i < 1000; i++) w[i] = (float)i * 0.5f;
    test_dev_write(dev, w, sizeof w);
  }
  test_dev_free(dev);
  ferry_engine_destroy(f.e);
  remove_dir(dir);
  return 0;
}
