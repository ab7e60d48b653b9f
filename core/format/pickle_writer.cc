#include "core/format/pickle_writer.h"

#include <cstring>
#include <map>
#include <vector>

#include "core/format/pickle_text.h"

namespace ucp::pickle {

namespace {

// CPython's pickler splits APPENDS/SETITEMS into batches of this many items.
constexpr size_t kBatchSize = 1000;

class Pickler {
 public:
  Result<std::string> Run(const Value* root) {
    if (root == nullptr) return Status::InvalidArgument("pickle: write: null root");
    CountReferences(root);
    out_ += "\x80\x02";
    UCP_RETURN_IF_ERROR(Save(root, 0));
    out_ += '.';
    return std::move(out_);
  }

 private:
  // How often each node is reached, for the nodes memoized only when shared.
  void CountReferences(const Value* root) {
    std::vector<const Value*> pending = {root};
    refs_[root] = 1;
    const auto visit = [&](const Value* child) {
      if (child == nullptr) return;
      if (refs_[child]++ == 0) pending.push_back(child);
    };
    while (!pending.empty()) {
      const Value* v = pending.back();
      pending.pop_back();
      switch (v->kind()) {
        case Kind::kTuple:
        case Kind::kList:
        case Kind::kSet:
        case Kind::kFrozenSet:
          for (const Value* item : v->items()) visit(item);
          break;
        case Kind::kDict:
          for (const auto& [key, value] : v->entries()) {
            visit(key);
            visit(value);
          }
          break;
        case Kind::kObject:
          visit(v->callable());
          visit(v->args());
          visit(v->kwargs());
          for (const Mutation& m : v->mutations()) {
            visit(m.first);
            visit(m.second);
          }
          break;
        case Kind::kPersistentId:
          visit(v->pid());
          break;
        default:
          break;
      }
    }
  }

  // ---- memo ----

  void WriteMemoOp(char short_op, char long_op, uint64_t index) {
    if (index < 256) {
      out_ += short_op;
      out_ += static_cast<char>(index);
    } else {
      out_ += long_op;
      AppendLe(static_cast<uint32_t>(index), 4);
    }
  }

  // BINPUT for a node just built.
  void Memoize(const Value* v) {
    const uint64_t index = next_memo_++;
    memo_[v] = static_cast<int64_t>(index);
    WriteMemoOp('q', 'r', index);
  }

  uint64_t MemoizeAnonymous() {
    const uint64_t index = next_memo_++;
    WriteMemoOp('q', 'r', index);
    return index;
  }

  void Get(uint64_t index) { WriteMemoOp('h', 'j', index); }

  // ---- primitives ----

  void AppendLe(uint64_t v, size_t width) {
    for (size_t i = 0; i < width; ++i) out_ += static_cast<char>((v >> (8 * i)) & 0xff);
  }

  void WriteInt(const Value* v) {
    const std::optional<int64_t> small = v->AsInt64();
    if (small && *small >= 0 && *small <= 0xff) {
      out_ += 'K';
      AppendLe(static_cast<uint64_t>(*small), 1);
    } else if (small && *small >= 0 && *small <= 0xffff) {
      out_ += 'M';
      AppendLe(static_cast<uint64_t>(*small), 2);
    } else if (small && *small >= INT32_MIN && *small <= INT32_MAX) {
      out_ += 'J';
      AppendLe(static_cast<uint32_t>(static_cast<int32_t>(*small)), 4);
    } else {
      const std::string bytes = v->IntBytes();
      if (bytes.size() < 256) {
        out_ += '\x8a';
        AppendLe(bytes.size(), 1);
      } else {
        out_ += '\x8b';
        AppendLe(bytes.size(), 4);
      }
      out_ += bytes;
    }
  }

  void WriteFloat(double d) {
    uint64_t bits;
    std::memcpy(&bits, &d, sizeof(bits));
    out_ += 'G';
    for (int shift = 56; shift >= 0; shift -= 8) out_ += static_cast<char>((bits >> shift) & 0xff);
  }

  Status WriteUnicode(std::string_view utf8) {
    if (!IsValidUtf8(utf8, true)) {
      return Status::InvalidArgument("pickle: write: str is not UTF-8");
    }
    if (utf8.size() > UINT32_MAX) {
      return Status::InvalidArgument("pickle: write: str of " + std::to_string(utf8.size()) +
                                     " bytes is over protocol 2's 4 GiB limit");
    }
    out_ += 'X';
    AppendLe(utf8.size(), 4);
    out_ += utf8;
    return Status::Ok();
  }

  // GLOBAL module\nname\n, memoized per name (one class object is one memo entry in Python).
  // Protocol 2 unpicklers look names up with a plain getattr, so a nested name such as
  // "Outer.Inner" is written as CPython writes it: getattr(<module.Outer>, "Inner").
  // `depth` is the nesting of the global's place; each getattr level nests two deeper (the
  // reduction's argument tuple, then the parent), as the read-back graph will.
  Status SaveGlobal(const std::string& module, const std::string& name, uint32_t depth) {
    UCP_RETURN_IF_ERROR(CheckDepth(depth));
    const auto key = std::make_pair(module, name);
    if (auto it = global_memo_.find(key); it != global_memo_.end()) {
      Get(it->second);
      return Status::Ok();
    }
    if (module.find('\n') != std::string::npos || name.find('\n') != std::string::npos ||
        !IsValidUtf8(module, false) || !IsValidUtf8(name, false)) {
      return Status::InvalidArgument("pickle: write: global name '" + module + "." + name +
                                     "' has a newline or is not UTF-8");
    }
    if (const size_t dot = name.rfind('.'); dot != std::string::npos) {
      UCP_RETURN_IF_ERROR(SaveGlobal("__builtin__", "getattr", depth + 1));
      UCP_RETURN_IF_ERROR(SaveGlobal(module, name.substr(0, dot), depth + 2));
      UCP_RETURN_IF_ERROR(WriteUnicode(name.substr(dot + 1)));
      MemoizeAnonymous();
      out_ += '\x86';
      MemoizeAnonymous();
      out_ += 'R';
    } else {
      out_ += 'c';
      out_ += module;
      out_ += '\n';
      out_ += name;
      out_ += '\n';
    }
    global_memo_[key] = MemoizeAnonymous();
    return Status::Ok();
  }

  // The protocol 2 spelling of bytes: _codecs.encode(latin-1 text, 'latin1'), or bytes().
  // Leaves the value on the stack without memoizing it. `depth` is the bytes value's; the text
  // sits two deeper once read back.
  Status SaveBytesReduction(std::string_view bytes, uint32_t depth) {
    UCP_RETURN_IF_ERROR(CheckDepth(depth + 2));
    if (bytes.empty()) {
      UCP_RETURN_IF_ERROR(SaveGlobal("__builtin__", "bytes", depth + 1));
      out_ += ")R";
      return Status::Ok();
    }
    UCP_RETURN_IF_ERROR(SaveGlobal("_codecs", "encode", depth + 1));
    std::string text;
    for (char c : bytes) AppendUtf8(text, static_cast<uint8_t>(c));
    UCP_RETURN_IF_ERROR(WriteUnicode(text));
    MemoizeAnonymous();
    // 'latin1' is one interned str in CPython, so it is written once and fetched after.
    if (latin1_memo_) {
      Get(*latin1_memo_);
    } else {
      UCP_RETURN_IF_ERROR(WriteUnicode("latin1"));
      latin1_memo_ = MemoizeAnonymous();
    }
    out_ += '\x86';
    MemoizeAnonymous();
    out_ += 'R';
    return Status::Ok();
  }

  // ---- containers ----

  // The items of `items` by CPython's iterator batching (save_reduce's listitems): a lone last
  // item as APPEND, groups of two or more as MARK ... APPENDS.
  Status SaveAppendRun(const std::vector<const Value*>& items, uint32_t depth) {
    for (size_t start = 0; start < items.size(); start += kBatchSize) {
      const size_t n = std::min(kBatchSize, items.size() - start);
      if (n == 1) {
        UCP_RETURN_IF_ERROR(Save(items[start], depth + 1));
        out_ += 'a';
        continue;
      }
      out_ += '(';
      for (size_t i = start; i < start + n; ++i) UCP_RETURN_IF_ERROR(Save(items[i], depth + 1));
      out_ += 'e';
    }
    return Status::Ok();
  }

  Status SaveSetItemRun(const std::vector<std::pair<const Value*, const Value*>>& pairs,
                        uint32_t depth) {
    for (size_t start = 0; start < pairs.size(); start += kBatchSize) {
      const size_t n = std::min(kBatchSize, pairs.size() - start);
      if (n == 1) {
        UCP_RETURN_IF_ERROR(Save(pairs[start].first, depth + 1));
        UCP_RETURN_IF_ERROR(Save(pairs[start].second, depth + 1));
        out_ += 's';
        continue;
      }
      out_ += '(';
      for (size_t i = start; i < start + n; ++i) {
        UCP_RETURN_IF_ERROR(Save(pairs[i].first, depth + 1));
        UCP_RETURN_IF_ERROR(Save(pairs[i].second, depth + 1));
      }
      out_ += 'u';
    }
    return Status::Ok();
  }

  // A list's elements as CPython's batch_list_exact writes them: APPEND for a one-element
  // list, else MARK ... APPENDS per batch.
  Status SaveListItems(const std::vector<Value*>& items, uint32_t depth) {
    if (items.size() == 1) {
      UCP_RETURN_IF_ERROR(Save(items[0], depth + 1));
      out_ += 'a';
      return Status::Ok();
    }
    for (size_t start = 0; start < items.size(); start += kBatchSize) {
      out_ += '(';
      const size_t end = std::min(items.size(), start + kBatchSize);
      for (size_t i = start; i < end; ++i) UCP_RETURN_IF_ERROR(Save(items[i], depth + 1));
      out_ += 'e';
    }
    return Status::Ok();
  }

  // A dict's pairs as CPython's batch_dict_exact writes them, including its empty trailing
  // MARK SETITEMS when the size is a multiple of the batch size.
  Status SaveDictItems(const std::vector<std::pair<Value*, Value*>>& entries, uint32_t depth) {
    if (entries.empty()) return Status::Ok();
    if (entries.size() == 1) {
      UCP_RETURN_IF_ERROR(Save(entries[0].first, depth + 1));
      UCP_RETURN_IF_ERROR(Save(entries[0].second, depth + 1));
      out_ += 's';
      return Status::Ok();
    }
    size_t next = 0;
    size_t in_batch;
    do {
      out_ += '(';
      in_batch = 0;
      while (next < entries.size() && in_batch < kBatchSize) {
        UCP_RETURN_IF_ERROR(Save(entries[next].first, depth + 1));
        UCP_RETURN_IF_ERROR(Save(entries[next].second, depth + 1));
        ++next;
        ++in_batch;
      }
      out_ += 'u';
    } while (in_batch == kBatchSize);
    return Status::Ok();
  }

  // After the parts of an immutable value were written: if writing them memoized the value
  // itself (a cycle through a mutable container), drop what is on the stack (`drop`: POPs or
  // POP_MARK) and fetch the memoized value, as CPython does.
  bool FetchIfMemoized(const Value* v, std::string_view drop) {
    const int64_t index = memo_[v];
    if (index < 0) return false;
    out_ += drop;
    Get(static_cast<uint64_t>(index));
    return true;
  }

  Status SaveTuple(const Value* v, uint32_t depth) {
    const auto& items = v->items();
    if (items.empty()) {
      out_ += ')';
      return Status::Ok();
    }
    if (items.size() <= 3) {
      for (const Value* item : items) UCP_RETURN_IF_ERROR(Save(item, depth + 1));
      if (FetchIfMemoized(v, std::string(items.size(), '0'))) return Status::Ok();
      out_ += static_cast<char>(0x84 + items.size());
      Memoize(v);
      return Status::Ok();
    }
    out_ += '(';
    for (const Value* item : items) UCP_RETURN_IF_ERROR(Save(item, depth + 1));
    if (FetchIfMemoized(v, "1")) return Status::Ok();
    out_ += 't';
    Memoize(v);
    return Status::Ok();
  }

  // set/frozenset/bytearray: GLOBAL cls, then the argument tuple, REDUCE, memoized. Read back,
  // the argument tuple is one deeper than the value and its list or bytes two.
  Status SaveReduction(const Value* v, const char* cls, uint32_t depth) {
    UCP_RETURN_IF_ERROR(CheckDepth(depth + 2));
    UCP_RETURN_IF_ERROR(SaveGlobal("__builtin__", cls, depth + 1));
    if (v->kind() == Kind::kByteArray) {
      if (v->data().empty()) {
        out_ += ')';
      } else {
        UCP_RETURN_IF_ERROR(SaveBytesReduction(v->data(), depth + 2));
        MemoizeAnonymous();
        out_ += '\x85';
        MemoizeAnonymous();
      }
    } else {
      out_ += ']';
      MemoizeAnonymous();
      UCP_RETURN_IF_ERROR(SaveListItems(v->items(), depth + 2));
      out_ += '\x85';
      MemoizeAnonymous();
    }
    out_ += 'R';
    if (FetchIfMemoized(v, "0")) return Status::Ok();
    Memoize(v);
    return Status::Ok();
  }

  Status SaveObject(const Value* v, uint32_t depth) {
    const Value* args = v->args();
    if (args == nullptr || args->kind() != Kind::kTuple || v->callable() == nullptr) {
      return Status::InvalidArgument("pickle: write: object without a callable or arg tuple");
    }
    switch (v->construction()) {
      case Construction::kReduce:
      case Construction::kNewObj:
        UCP_RETURN_IF_ERROR(Save(v->callable(), depth + 1));
        UCP_RETURN_IF_ERROR(Save(args, depth + 1));
        out_ += v->construction() == Construction::kReduce ? 'R' : '\x81';
        break;
      case Construction::kNewObjEx:
        if (v->kwargs() == nullptr || v->kwargs()->kind() != Kind::kDict) {
          return Status::InvalidArgument("pickle: write: NEWOBJ_EX object without kwargs dict");
        }
        UCP_RETURN_IF_ERROR(Save(v->callable(), depth + 1));
        UCP_RETURN_IF_ERROR(Save(args, depth + 1));
        UCP_RETURN_IF_ERROR(Save(v->kwargs(), depth + 1));
        out_ += '\x92';
        break;
      case Construction::kInst:
      case Construction::kObj:
        out_ += '(';
        UCP_RETURN_IF_ERROR(Save(v->callable(), depth + 1));
        // The arguments sit in the argument tuple, one level down.
        for (const Value* item : args->items()) UCP_RETURN_IF_ERROR(Save(item, depth + 2));
        out_ += 'o';
        break;
    }
    // CPython's save_reduce: the object was built while writing its own parts, so the copy
    // just built is dropped for the memoized one.
    if (FetchIfMemoized(v, "0")) return Status::Ok();
    Memoize(v);
    const auto& mutations = v->mutations();
    for (size_t i = 0; i < mutations.size();) {
      const Mutation::Op op = mutations[i].op;
      if (op == Mutation::Op::kBuild) {
        UCP_RETURN_IF_ERROR(Save(mutations[i].first, depth + 1));
        out_ += 'b';
        ++i;
        continue;
      }
      size_t end = i;
      while (end < mutations.size() && mutations[end].op == op) ++end;
      if (op == Mutation::Op::kAppend) {
        std::vector<const Value*> items;
        for (size_t k = i; k < end; ++k) items.push_back(mutations[k].first);
        UCP_RETURN_IF_ERROR(SaveAppendRun(items, depth));
      } else {
        std::vector<std::pair<const Value*, const Value*>> pairs;
        for (size_t k = i; k < end; ++k)
          pairs.emplace_back(mutations[k].first, mutations[k].second);
        UCP_RETURN_IF_ERROR(SaveSetItemRun(pairs, depth));
      }
      i = end;
    }
    return Status::Ok();
  }

  // ---- dispatch ----

  static Status CheckDepth(uint32_t depth) {
    if (depth <= kMaxDepth) return Status::Ok();
    return Status::OutOfRange("pickle: write: nesting deeper than " + std::to_string(kMaxDepth));
  }

  Status Save(const Value* v, uint32_t depth) {
    if (v == nullptr) return Status::InvalidArgument("pickle: write: null node");
    UCP_RETURN_IF_ERROR(CheckDepth(depth));
    if (const int64_t index = memo_[v]; index >= 0) {
      Get(static_cast<uint64_t>(index));
      return Status::Ok();
    }
    // A value reached again while its own parts are being written terminates only when a
    // container memoized before its contents lies on the way back to it.
    int64_t& on_path = path_index_[v];
    if (on_path >= 0 && (v->kind() == Kind::kSet || v->kind() == Kind::kFrozenSet)) {
      // Written as REDUCE(set, ([items],)), a set is memoized only after its items, so it would
      // be written twice over and read back as another graph. Python's sets hold only hashable
      // values, so no pickle of Python's holds such a set.
      return Status::InvalidArgument("pickle: write: a " + std::string(KindName(v->kind())) +
                                     " contains itself");
    }
    if (on_path >= 0) {
      bool broken = false;
      for (size_t i = static_cast<size_t>(on_path) + 1; i < path_.size() && !broken; ++i) {
        broken = memo_[path_[i]] >= 0;
      }
      if (!broken) {
        return Status::InvalidArgument("pickle: write: a " + std::string(KindName(v->kind())) +
                                       " contains itself through immutable values only");
      }
    }
    const bool first_on_path = on_path < 0;
    if (first_on_path) on_path = static_cast<int64_t>(path_.size());
    path_.push_back(v);
    Status status = SaveNew(v, depth);
    path_.pop_back();
    if (first_on_path) path_index_[v] = -1;
    return status;
  }

  Status SaveNew(const Value* v, uint32_t depth) {
    switch (v->kind()) {
      case Kind::kNone:
        out_ += 'N';
        return Status::Ok();
      case Kind::kBool:
        out_ += v->bool_value() ? '\x88' : '\x89';
        return Status::Ok();
      case Kind::kInt:
        WriteInt(v);
        return Status::Ok();
      case Kind::kFloat:
        WriteFloat(v->float_value());
        return Status::Ok();
      case Kind::kStr:
        UCP_RETURN_IF_ERROR(WriteUnicode(v->data()));
        Memoize(v);
        return Status::Ok();
      case Kind::kBytes:
        UCP_RETURN_IF_ERROR(SaveBytesReduction(v->data(), depth));
        Memoize(v);
        return Status::Ok();
      case Kind::kByteArray:
        return SaveReduction(v, "bytearray", depth);
      case Kind::kSet:
        return SaveReduction(v, "set", depth);
      case Kind::kFrozenSet:
        return SaveReduction(v, "frozenset", depth);
      case Kind::kTuple:
        return SaveTuple(v, depth);
      case Kind::kList:
        out_ += ']';
        Memoize(v);
        return SaveListItems(v->items(), depth);
      case Kind::kDict:
        out_ += '}';
        Memoize(v);
        return SaveDictItems(v->entries(), depth);
      case Kind::kGlobal:
        return SaveGlobal(v->module(), v->name(), depth);
      case Kind::kObject:
        return SaveObject(v, depth);
      case Kind::kPersistentId:
        UCP_RETURN_IF_ERROR(Save(v->pid(), depth + 1));
        if (FetchIfMemoized(v, "0")) return Status::Ok();
        out_ += 'Q';
        if (refs_[v] > 1) Memoize(v);
        return Status::Ok();
      case Kind::kExtension: {
        const int32_t code = v->extension_code();
        if (code <= 0) return Status::InvalidArgument("pickle: write: extension code <= 0");
        if (code <= 0xff) {
          out_ += '\x82';
          AppendLe(static_cast<uint32_t>(code), 1);
        } else if (code <= 0xffff) {
          out_ += '\x83';
          AppendLe(static_cast<uint32_t>(code), 2);
        } else {
          out_ += '\x84';
          AppendLe(static_cast<uint32_t>(code), 4);
        }
        if (refs_[v] > 1) Memoize(v);
        return Status::Ok();
      }
    }
    return Status::Internal("pickle: write: unknown node kind");
  }

  std::string out_;
  uint64_t next_memo_ = 0;
  NodeMap<int64_t> memo_{-1};  // memo index, -1 when not memoized
  std::map<std::pair<std::string, std::string>, uint64_t> global_memo_;
  std::optional<uint64_t> latin1_memo_;
  NodeMap<uint32_t> refs_;
  std::vector<const Value*> path_;   // the nodes being written, outermost first
  NodeMap<int64_t> path_index_{-1};  // first position in path_, -1 when absent
};

}  // namespace

Result<std::string> WritePickle(const Value* root) { return Pickler().Run(root); }

}  // namespace ucp::pickle
