// KV offload tier on its own: a pool, a prefix index and the tier, no model. Evicted pages go to
// the tier with their bytes; a load returns exactly those bytes, only for the same parent and
// tokens; the tier reuses its least recently used slot when full; PrefixIndex::restore caches a
// loaded page so that the next lookup adopts it.
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <random>

#include "cache/kv_offload.h"
#include "cache/page_pool.h"
#include "cache/prefix_index.h"
#include "core/error.h"

namespace fs = std::filesystem;
using namespace kvq;

namespace {

constexpr int P = 16;
constexpr size_t kPageBytes = 5000;  // not a multiple of 4 KiB: slots are padded
const KvHashKey test_key{1, 2, 3, 4};

std::vector<int32_t> tokens_of(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(size_t(n), 0);
  for (auto& x : t) x = int32_t(rng() % 32000);
  return t;
}

void fill(PagePool& pool, KvPageId page, uint8_t seed) {
  uint8_t* d = pool.data(page);
  for (size_t i = 0; i < pool.page_bytes(); ++i) d[i] = uint8_t(seed * 31 + i * 7);
}

bool holds(const PagePool& pool, KvPageId page, uint8_t seed) {
  const uint8_t* d = pool.data(page);
  for (size_t i = 0; i < pool.page_bytes(); ++i)
    if (d[i] != uint8_t(seed * 31 + i * 7)) return false;
  return true;
}

// A pool whose prefix index spills into a tier; detached and emptied in order at the end.
struct Rig {
  PagePool pool;
  PrefixIndex idx;
  std::unique_ptr<KvOffload> tier;
  Rig(size_t pages, std::vector<int> groups = {0}) : pool(pages, kPageBytes, P), idx("id", P, std::move(groups), &test_key) {
    pool.set_evictor(&idx);
  }
  KvOffload& attach(const fs::path& dir, size_t bytes, bool direct = false) {
    tier = std::make_unique<KvOffload>(dir.string(), bytes, pool, direct);
    idx.set_spill(tier.get());
    return *tier;
  }
  // A persistent tier (KvOffloadOptions::persist) for cache identity `id`.
  KvOffload& attach_persistent(const fs::path& dir, size_t bytes, const std::string& id, bool direct = false) {
    tier = std::make_unique<KvOffload>(KvOffloadOptions{dir.string(), bytes, direct, true, id}, pool);
    idx.set_spill(tier.get());
    return *tier;
  }
  // A one-page prefix of `seed`'s tokens and bytes, computed, released and evicted (into the tier):
  // its hash.
  KvHash evict_one(uint32_t seed) {
    const auto t = tokens_of(P, seed);
    const KvPageId p = pool.alloc();
    EXPECT_NE(p, kv_page_none);
    fill(pool, p, uint8_t(seed));
    KvHash h;
    EXPECT_EQ(idx.insert(idx.root(), t.data(), p, &h), PrefixIndex::Insert::inserted);
    pool.unref(p);
    std::vector<KvPageId> all;
    EXPECT_TRUE(pool.alloc_n(pool.n_available(), all));
    for (KvPageId q : all) pool.unref(q);
    return h;
  }
  // The tier gives back `seed`'s page (evict_one) byte for byte.
  bool gives_back(const KvHash& h, uint32_t seed) {
    const KvPageId p = pool.alloc();
    const bool ok = p != kv_page_none && tier->load(h, 0, idx.root(), tokens_of(P, seed).data(), p) &&
                    holds(pool, p, uint8_t(seed));
    if (p != kv_page_none) pool.unref(p);
    return ok;
  }
  ~Rig() {
    idx.set_spill(nullptr);
    pool.evict_idle();
    pool.set_evictor(nullptr);
  }
};

struct TierTest : ::testing::Test {
  fs::path dir;
  void SetUp() override {
    dir = fs::temp_directory_path() / ("kvq_test_tier_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
                                       "_" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir);
  }
  void TearDown() override { fs::remove_all(dir); }
};

}  // namespace

TEST_F(TierTest, EvictedPagesAreKeptAndReadBackOnlyForTheirPrefix) {
  Rig rig(3);
  PagePool& pool = rig.pool;
  PrefixIndex& idx = rig.idx;
  KvOffload& tier = rig.attach(dir, 4 * 8192);
  EXPECT_EQ(tier.capacity_pages(), 4u);  // 5000-byte pages in 8 KiB slots
  EXPECT_TRUE(fs::is_empty(dir));         // the file is unlinked

  // A sequence computes two pages of a prefix and releases them: cached, idle.
  const auto a = tokens_of(2 * P, 1);
  std::vector<KvPageId> seq;
  ASSERT_TRUE(pool.alloc_n(2, seq));
  fill(pool, seq[0], 10);
  fill(pool, seq[1], 11);
  KvHash h0, h1;
  ASSERT_EQ(idx.insert(idx.root(), a.data(), seq[0], &h0), PrefixIndex::Insert::inserted);
  ASSERT_EQ(idx.insert(h0, a.data() + P, seq[1], &h1), PrefixIndex::Insert::inserted);
  pool.unref(seq[1]);
  pool.unref(seq[0]);

  // Another sequence takes every page: both cached pages are evicted into the tier.
  std::vector<KvPageId> big;
  ASSERT_TRUE(pool.alloc_n(3, big));
  EXPECT_EQ(idx.lookup(a.data(), 2 * P).n_tokens(), 0);
  EXPECT_TRUE(tier.contains(h0, 0));
  EXPECT_TRUE(tier.contains(h1, 0));
  EXPECT_FALSE(tier.contains(h1, 1));
  EXPECT_EQ(tier.stats().stored_pages, 2u);
  for (KvPageId p : big) pool.unref(p);

  // Read back into fresh pages: the same bytes, only for the same parent and tokens.
  const KvPageId p0 = pool.alloc();
  const KvPageId p1 = pool.alloc();
  EXPECT_FALSE(tier.load(h0, 0, h1, a.data(), p0));  // wrong parent
  auto b = a;
  b[3] ^= 1;
  EXPECT_FALSE(tier.load(h0, 0, idx.root(), b.data(), p0));  // other tokens
  EXPECT_FALSE(tier.load(h0, 1, idx.root(), a.data(), p0));  // other group
  ASSERT_TRUE(tier.load(h0, 0, idx.root(), a.data(), p0));
  ASSERT_TRUE(tier.load(h1, 0, h0, a.data() + P, p1));
  EXPECT_TRUE(holds(pool, p0, 10));
  EXPECT_TRUE(holds(pool, p1, 11));
  EXPECT_EQ(tier.stats().loaded_pages, 2u);

  // Cached again through restore: the next lookup adopts both.
  EXPECT_TRUE(idx.restore(h0, a.data() + P, 0, p1));  // page 1, after the prefix h0
  EXPECT_EQ(idx.page_of(h1, 0), p1);
  EXPECT_EQ(idx.lookup(a.data(), 2 * P).n_tokens(), 0);  // page 0 is not cached yet
  EXPECT_TRUE(idx.restore(idx.root(), a.data(), 0, p0));
  EXPECT_EQ(idx.page_of(h0, 0), p0);
  const KvPageId spare = pool.alloc();
  ASSERT_NE(spare, kv_page_none);
  EXPECT_FALSE(idx.restore(idx.root(), a.data(), 0, spare));  // the place is taken
  pool.unref(spare);
  const KvPrefixMatch m = idx.lookup(a.data(), 2 * P);
  ASSERT_EQ(m.pages.size(), 2u);
  EXPECT_EQ(m.pages[0], p0);
  EXPECT_EQ(m.pages[1], p1);

  // Evicted again: the tier holds them already (no second write).
  pool.unref(p1);
  pool.unref(p0);
  std::vector<KvPageId> again;
  ASSERT_TRUE(pool.alloc_n(pool.n_available(), again));
  EXPECT_EQ(tier.stats().stored_pages, 2u);
  EXPECT_EQ(tier.stats().kept_pages, 2u);
  for (KvPageId p : again) pool.unref(p);
}

TEST_F(TierTest, FullTierReusesTheLeastRecentlyUsedSlot) {
  Rig rig(2);
  PagePool& pool = rig.pool;
  PrefixIndex& idx = rig.idx;
  KvOffload& tier = rig.attach(dir, 2 * 8192);
  // Three one-page prefixes computed and evicted in turn: the tier (2 slots) keeps the last two,
  // unless a touch made an older one the more recent.
  std::vector<KvHash> h(3);
  std::vector<std::vector<int32_t>> t;
  for (int i = 0; i < 3; ++i) {
    t.push_back(tokens_of(P, 100 + uint32_t(i)));
    const KvPageId p = pool.alloc();
    ASSERT_NE(p, kv_page_none);
    fill(pool, p, uint8_t(i));
    ASSERT_EQ(idx.insert(idx.root(), t.back().data(), p, &h[size_t(i)]), PrefixIndex::Insert::inserted);
    pool.unref(p);
    std::vector<KvPageId> all;
    ASSERT_TRUE(pool.alloc_n(2, all));  // evicts it
    for (KvPageId q : all) pool.unref(q);
    if (i == 1) tier.touch(h[0], 0);  // now the most recent: h[1] goes first
  }
  EXPECT_TRUE(tier.contains(h[0], 0));
  EXPECT_FALSE(tier.contains(h[1], 0));
  EXPECT_TRUE(tier.contains(h[2], 0));
  const KvOffloadStats s = tier.stats();
  EXPECT_EQ(s.stored_pages, 3u);
  EXPECT_EQ(s.dropped_pages, 1u);
  EXPECT_EQ(s.resident_pages, 2u);
  const KvPageId p = pool.alloc();
  ASSERT_TRUE(tier.load(h[0], 0, idx.root(), t[0].data(), p));
  EXPECT_TRUE(holds(pool, p, 0));
  pool.unref(p);
}

TEST_F(TierTest, PageGroupsAreKeptApartAndRestoredAfterGroupZero) {
  // Group 1 is a sliding group (window 32): its page of a position is restored only once the
  // position's group-0 page is cached.
  Rig rig(4, std::vector<int>{0, 32});
  PagePool& pool = rig.pool;
  PrefixIndex& idx = rig.idx;
  KvOffload& tier = rig.attach(dir, 8 * 8192);
  const auto a = tokens_of(P, 5);
  std::vector<KvPageId> pages;
  ASSERT_TRUE(pool.alloc_n(2, pages));
  fill(pool, pages[0], 20);
  fill(pool, pages[1], 21);
  KvHash h;
  ASSERT_EQ(idx.insert(idx.root(), a.data(), pages, &h), PrefixIndex::Insert::inserted);
  pool.unref(pages[1]);
  pool.unref(pages[0]);
  std::vector<KvPageId> all;
  ASSERT_TRUE(pool.alloc_n(4, all));
  for (KvPageId q : all) pool.unref(q);
  ASSERT_TRUE(tier.contains(h, 0));
  ASSERT_TRUE(tier.contains(h, 1));
  const KvPageId g0 = pool.alloc(), g1 = pool.alloc();
  ASSERT_TRUE(tier.load(h, 1, idx.root(), a.data(), g1));
  EXPECT_TRUE(holds(pool, g1, 21));
  EXPECT_FALSE(idx.restore(idx.root(), a.data(), 1, g1));  // group 0 is not cached
  ASSERT_TRUE(tier.load(h, 0, idx.root(), a.data(), g0));
  EXPECT_TRUE(holds(pool, g0, 20));
  EXPECT_TRUE(idx.restore(idx.root(), a.data(), 0, g0));
  EXPECT_TRUE(idx.restore(idx.root(), a.data(), 1, g1));
  EXPECT_EQ(idx.page_of(h, 0), g0);
  EXPECT_EQ(idx.page_of(h, 1), g1);
  const KvPrefixMatch m = idx.lookup(a.data(), P);
  ASSERT_EQ(m.pages.size(), 1u);
  EXPECT_EQ(m.window_pages[0][0], g1);
  pool.unref(g1);
  pool.unref(g0);
}

TEST_F(TierTest, BadPlacesAndSizesAreRefused) {
  PagePool pool(1, kPageBytes, P);
  const auto error_of = [&](const std::string& d, size_t bytes) {
    try {
      KvOffload t(d, bytes, pool);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error_of((dir / "nope").string(), 1 << 20).find("is not a directory"), std::string::npos);
  EXPECT_NE(error_of(dir.string(), 8191).find("holds no KV page"), std::string::npos);
  EXPECT_EQ(error_of(dir.string(), 8192), "");
}

// A write past the file's end that fails (here: the file size limit, as a full disk would) drops
// that page as if there were no tier, and the tier shrinks to the slots it has and reuses them;
// writes that fail in a row on those (a limit of 0) stop the tier after KvOffload::kMaxWriteErrors.
// Nothing throws, and what the tier holds stays readable.
TEST_F(TierTest, FailedWritesShrinkTheTierThenStopIt) {
  Rig rig(2);
  PagePool& pool = rig.pool;
  PrefixIndex& idx = rig.idx;
  KvOffload& tier = rig.attach(dir, 64 * 8192);
  const auto evict_one = [&](uint32_t seed, KvHash* h) {
    const auto t = tokens_of(P, seed);
    const KvPageId p = pool.alloc();
    ASSERT_NE(p, kv_page_none);
    fill(pool, p, uint8_t(seed));
    ASSERT_EQ(idx.insert(idx.root(), t.data(), p, h), PrefixIndex::Insert::inserted);
    pool.unref(p);
    std::vector<KvPageId> all;
    ASSERT_TRUE(pool.alloc_n(2, all));
    for (KvPageId q : all) pool.unref(q);
  };
  KvHash first;
  evict_one(1, &first);  // slot 0, within the limit below
  ASSERT_TRUE(tier.contains(first, 0));
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  const auto prev = std::signal(SIGXFSZ, SIG_IGN);
  rlimit lim = old;
  lim.rlim_cur = 8192;  // one slot: slot 1's write fails (EFBIG)
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &lim), 0);
  std::vector<KvHash> later(4);
  for (size_t i = 0; i < later.size(); ++i) evict_one(10 + uint32_t(i), &later[i]);
  KvOffloadStats s = tier.stats();
  EXPECT_EQ(s.write_errors, 1u);
  EXPECT_EQ(s.capacity_pages, 1u);
  EXPECT_TRUE(s.writing);
  EXPECT_FALSE(tier.contains(later[0], 0));  // its write failed
  EXPECT_TRUE(tier.contains(later.back(), 0));  // slot 0, reused
  EXPECT_FALSE(tier.contains(first, 0));
  {
    const KvPageId p = pool.alloc();
    ASSERT_TRUE(tier.load(later.back(), 0, idx.root(), tokens_of(P, 13).data(), p));
    EXPECT_TRUE(holds(pool, p, 13));
    pool.unref(p);
  }
  // A limit of 0: even slot 0 cannot be written; after kMaxWriteErrors failures in a row the tier
  // stops writing.
  lim.rlim_cur = 0;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &lim), 0);
  std::vector<KvHash> lost(size_t(KvOffload::kMaxWriteErrors) + 2);
  for (size_t i = 0; i < lost.size(); ++i) evict_one(100 + uint32_t(i), &lost[i]);
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, prev);
  s = tier.stats();
  EXPECT_EQ(s.write_errors, 1u + uint64_t(KvOffload::kMaxWriteErrors));  // then it stopped trying
  EXPECT_FALSE(s.writing);
  for (const KvHash& h : lost) EXPECT_FALSE(tier.contains(h, 0));
  // The slot dropped for the first failed rewrite held later.back(); nothing else is held.
  EXPECT_EQ(s.resident_pages, 0u);
}

// --kv-offload-direct: the same pages, through O_DIRECT and a bounce buffer (a 5000-byte page in an
// 8 KiB slot); skipped where the temporary directory's file system refuses O_DIRECT (tmpfs).
TEST_F(TierTest, DirectIoKeepsTheSameBytes) {
  Rig rig(2);
  PagePool& pool = rig.pool;
  PrefixIndex& idx = rig.idx;
  try {
    rig.attach(dir, 4 * 8192, true);
  } catch (const Error& e) {
    ASSERT_NE(std::string(e.what()).find("does not take O_DIRECT"), std::string::npos) << e.what();
    GTEST_SKIP() << e.what();
  }
  KvOffload* tier = rig.tier.get();
  std::vector<KvHash> h(2);
  std::vector<std::vector<int32_t>> t;
  for (int i = 0; i < 2; ++i) {
    t.push_back(tokens_of(P, 50 + uint32_t(i)));
    const KvPageId p = pool.alloc();
    fill(pool, p, uint8_t(40 + i));
    ASSERT_EQ(idx.insert(idx.root(), t.back().data(), p, &h[size_t(i)]), PrefixIndex::Insert::inserted);
    pool.unref(p);
  }
  std::vector<KvPageId> all;
  ASSERT_TRUE(pool.alloc_n(2, all));  // evicts both
  EXPECT_EQ(tier->stats().stored_pages, 2u);
  EXPECT_EQ(tier->stats().write_errors, 0u);
  for (int i = 1; i >= 0; --i) {
    ASSERT_TRUE(tier->load(h[size_t(i)], 0, idx.root(), t[size_t(i)].data(), all[size_t(i)]));
    EXPECT_TRUE(holds(pool, all[size_t(i)], uint8_t(40 + i)));
  }
  for (KvPageId q : all) pool.unref(q);
}

// --kv-offload-persist: the tier's file outlives the tier. The next tier with the same identity
// starts from its pages (every one readable, byte for byte), in their order of use, with the same
// hash key; a tier with another identity has a file of its own. Through O_DIRECT too (skipped
// where the file system refuses it).
TEST_F(TierTest, PersistentTierKeepsItsPagesForTheNextRun) {
  for (const bool direct : {false, true}) {
    SCOPED_TRACE(direct ? "O_DIRECT" : "buffered");
    fs::remove_all(dir);
    fs::create_directories(dir);
    KvHashKey key;
    std::vector<KvHash> h(3);
    {
      Rig rig(2);
      try {
        rig.attach_persistent(dir, 4 * 8192, "model A; int8");
      } catch (const Error& e) {
        ASSERT_TRUE(direct) << e.what();
        GTEST_SKIP() << e.what();
      }
      if (direct) {
        try {
          rig.tier.reset();
          rig.attach_persistent(dir, 4 * 8192, "model A; int8", true);
        } catch (const Error& e) {
          ASSERT_NE(std::string(e.what()).find("does not take O_DIRECT"), std::string::npos) << e.what();
          GTEST_SKIP() << e.what();
        }
      }
      KvOffload& tier = *rig.tier;
      EXPECT_TRUE(tier.persistent());
      EXPECT_EQ(tier.stats().pages_at_start, 0u);
      EXPECT_EQ(tier.path(), KvOffload::persistent_path(dir.string(), "model A; int8"));
      EXPECT_TRUE(fs::exists(tier.path()));
      for (int i = 0; i < 3; ++i) h[size_t(i)] = rig.evict_one(uint32_t(i));
      tier.touch(h[0], 0);  // order of use: 1, 2, 0
      key = tier.key();
    }  // saved
    ASSERT_TRUE(fs::exists(KvOffload::persistent_path(dir.string(), "model A; int8")));
    {
      Rig rig(2);
      KvOffload& tier = rig.attach_persistent(dir, 4 * 8192, "model A; int8", direct);
      EXPECT_EQ(tier.stats().pages_at_start, 3u);
      EXPECT_EQ(tier.stats().resident_pages, 3u);
      EXPECT_EQ(tier.key().k0, key.k0);
      EXPECT_EQ(tier.key().k3, key.k3);
      for (int i = 0; i < 3; ++i) EXPECT_TRUE(tier.contains(h[size_t(i)], 0));
      // Two newer pages fill the 4 slots and take the least recently used: h[1].
      rig.evict_one(10);
      rig.evict_one(11);
      EXPECT_FALSE(tier.contains(h[1], 0));
      EXPECT_TRUE(rig.gives_back(h[0], 0));
      EXPECT_TRUE(rig.gives_back(h[2], 2));
      EXPECT_EQ(tier.stats().read_errors, 0u);
    }
    {
      Rig rig(2);
      KvOffload& tier = rig.attach_persistent(dir, 4 * 8192, "model B; int8", direct);
      EXPECT_EQ(tier.stats().pages_at_start, 0u);
      EXPECT_FALSE(tier.contains(h[0], 0));
      EXPECT_NE(tier.path(), KvOffload::persistent_path(dir.string(), "model A; int8"));
    }
    size_t files = 0;
    for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir)) ++files;
    EXPECT_EQ(files, 2u);
  }
}

namespace {
// Runs f in a child process that then ends at once (_exit: no destructor, as a killed server):
// its exit status.
template <typename F>
int in_child(F f) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int rc = f();
    ::_exit(rc);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}
}  // namespace

// A run that ends without saving (killed): if it wrote pages, the next run does not trust the
// file and starts empty; if it only read, the file is as it was saved and still serves.
TEST_F(TierTest, PersistentTierKilledAfterWritingStartsEmpty) {
  const std::string id = "model A; q4_0";
  KvHash h0;
  {
    Rig rig(2);
    rig.attach_persistent(dir, 4 * 8192, id);
    h0 = rig.evict_one(1);
  }
  // Killed after reading only.
  EXPECT_EQ(in_child([&] {
              Rig* rig = new Rig(2);  // never destroyed
              rig->attach_persistent(dir, 4 * 8192, id);
              return rig->gives_back(h0, 1) ? 0 : 3;
            }),
            0);
  {
    Rig rig(2);
    KvOffload& tier = rig.attach_persistent(dir, 4 * 8192, id);
    EXPECT_EQ(tier.stats().pages_at_start, 1u);
    EXPECT_TRUE(rig.gives_back(h0, 1));
  }
  // Killed after writing a page.
  EXPECT_EQ(in_child([&] {
              Rig* rig = new Rig(2);
              rig->attach_persistent(dir, 4 * 8192, id);
              rig->evict_one(2);
              return rig->tier->stats().stored_pages == 1 ? 0 : 3;
            }),
            0);
  Rig rig(2);
  KvOffload& tier = rig.attach_persistent(dir, 4 * 8192, id);
  EXPECT_EQ(tier.stats().pages_at_start, 0u);
  EXPECT_FALSE(tier.contains(h0, 0));
  // It goes on as a new tier.
  const KvHash h3 = rig.evict_one(3);
  EXPECT_TRUE(rig.gives_back(h3, 3));
}

// A damaged file (its header, its index, the identity it names, a truncation) starts empty; a
// second tier on a file in use is refused; a smaller tier keeps the pages of the slots it has.
TEST_F(TierTest, PersistentTierRefusesDamagedOrBusyFilesAndShrinks) {
  const std::string id = "model A; f16";
  const std::string path = KvOffload::persistent_path(dir.string(), id);
  std::vector<KvHash> h(3);
  const auto save_three = [&] {
    fs::remove(path);
    Rig rig(2);
    rig.attach_persistent(dir, 4 * 8192, id);
    for (int i = 0; i < 3; ++i) h[size_t(i)] = rig.evict_one(uint32_t(20 + i));
  };
  const auto pages_at_start = [&] {
    Rig rig(2);
    return rig.attach_persistent(dir, 4 * 8192, id).stats().pages_at_start;
  };
  const auto flip = [&](std::streamoff at) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(at);
    char c = 0;
    f.read(&c, 1);
    c = char(c ^ 0x40);
    f.seekp(at);
    f.write(&c, 1);
  };
  save_three();
  EXPECT_EQ(pages_at_start(), 3u);  // (a tier that only read leaves the file as it was)
  const auto size = std::streamoff(fs::file_size(path));
  flip(size - 5);  // the index's last entry
  EXPECT_EQ(pages_at_start(), 0u);
  save_three();
  flip(20);  // the header
  EXPECT_EQ(pages_at_start(), 0u);
  save_three();
  flip(4096 + 3);  // the identity string
  EXPECT_EQ(pages_at_start(), 0u);
  save_three();
  fs::resize_file(path, fs::file_size(path) - 100);
  EXPECT_EQ(pages_at_start(), 0u);

  // Busy: one tier per file.
  save_three();
  {
    Rig rig(2);
    rig.attach_persistent(dir, 4 * 8192, id);
    PagePool other(1, kPageBytes, P);
    try {
      KvOffload second(KvOffloadOptions{dir.string(), 4 * 8192, false, true, id}, other);
      ADD_FAILURE() << "a second tier opened a file in use";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("in use by another process"), std::string::npos) << e.what();
    }
  }
  // A smaller tier: the pages of its slots (the first two stored) stay.
  {
    Rig rig(2);
    KvOffload& tier = rig.attach_persistent(dir, 2 * 8192, id);
    EXPECT_EQ(tier.stats().pages_at_start, 2u);
    EXPECT_TRUE(rig.gives_back(h[0], 20));
    EXPECT_TRUE(rig.gives_back(h[1], 21));
    EXPECT_FALSE(tier.contains(h[2], 0));
  }
  // A larger tier keeps them all and stores more beside them.
  save_three();
  {
    Rig rig(2);
    KvOffload& tier = rig.attach_persistent(dir, 8 * 8192, id);
    EXPECT_EQ(tier.stats().pages_at_start, 3u);
    for (uint32_t i = 0; i < 5; ++i) rig.evict_one(30 + i);
    EXPECT_EQ(tier.stats().dropped_pages, 0u);
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(rig.gives_back(h[size_t(i)], uint32_t(20 + i)));
  }
  // A slot whose bytes changed on disk (slot 0 holds the first page stored) is a failed read, a
  // miss; the others are read as they were.
  save_three();
  flip(std::streamoff(8192 + 8192 * 0 + 100));  // data at 4 KiB header + 4 KiB identity; 8 KiB slots
  {
    Rig rig(2);
    KvOffload& tier = rig.attach_persistent(dir, 4 * 8192, id);
    EXPECT_EQ(tier.stats().pages_at_start, 3u);
    EXPECT_FALSE(rig.gives_back(h[0], 20));
    EXPECT_EQ(tier.stats().read_errors, 1u);
    EXPECT_FALSE(tier.contains(h[0], 0));
    EXPECT_TRUE(rig.gives_back(h[1], 21));
    EXPECT_TRUE(rig.gives_back(h[2], 22));
  }
  // No identity: refused.
  PagePool pool(1, kPageBytes, P);
  EXPECT_THROW(KvOffload(KvOffloadOptions{dir.string(), 4 * 8192, false, true, ""}, pool), Error);
}
